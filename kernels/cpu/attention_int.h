// Integer-dot scores of the CPU attention over the hierarchical cache (hier_attention.cpp), for
// the paths whose linears round activations to int8 (the W8A8 target, the W4A8 draft).
//
// Keys are stored per channel: k_jd = s_d (u_jd - off) + z_d, with u the plane codes as bytes,
// U (draft, 0..15, off 0) or 16 U + lower (target, 0..255, off 8, step s / 16). So
//   q . k_j = sum_d (q_d s_d) u_jd + sum_d q_d (z_d - off s_d),
// and a = q * s is rounded to int16 per row and K group (`round_to_codes`, one step per head):
//   score_j = step * sum_d code_d u_jd + bias,   bias = sum_d q_d (z_d - off s_d) in fp32.
// int16, not int8: rounding the queries to int8 cost the W8A8 target +0.7% perplexity on
// SmolLM2-135M (qspec quality), int16 about nothing; the dots are a few percent of the
// kernel's time either way (the softmax and the values' fold are the rest). The integer sum
// is exact (|sum| <= 128 * 255 * 32767 < 2^31 for the vector paths' D <= 128), so a row's
// score depends neither on the order of the dims nor on how many rows share the call.
// The vector path (the SIMD layer's simd::Attn::row_dots: `vpdpwssd` on AVX-512 VNNI,
// `vpmaddwd` on AVX2) runs over the block's bytes widened to int16 once for all rows.
//
// Positions are the kernel's deinterleaved order: per segment of W dims (W = 64, or D when 64
// does not divide D), a byte b of the segment's W / 2 holds position b in its low nibble and
// W / 2 + b in its high one. Included by hier_attention.cpp alone.
#pragma once
#include "attention_math.h"
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace attn {

constexpr int64_t kMaxBlock = 32;  // tokens per block of the history (hier_attention.cpp)
// Head dims whose integer dots fit int32: D * 255 * 32767 < 2^31 (the Python side refuses more).
constexpr int64_t kMaxIntQueryDim = 256;

// Rows' rounded queries against one K group: codes [RT, D], step [RT], bias [RT].
struct IntQueries {
  std::vector<int16_t> codes;
  std::vector<float> step, bias;
  std::vector<float> s, z, scaled;  // [D] scratch: the group's s / div, z - off s; q s
};

// sum_d a_d b_d in one fixed order whatever the pointers' alignment (a vectorizer's peeling
// for alignment would move it with the buffer's address, and a row's bits with it).
inline float dot_fixed(const float* a, const float* b, int64_t D) {
  float sum;
  int64_t d = simd::Attn::dot_prefix(a, b, D, sum);  // the vector lanes' dims, if any
#pragma GCC novector
  for (; d < D; ++d) sum = std::fma(a[d], b[d], sum);
  return sum;
}

// q [RT, D] (deinterleaved, already / sqrt(D)); ks/kz: the group's scales and zeros in the
// original order, read through perm. The target's step is s / 16 and its bytes carry + 8.
inline void round_queries(const float* q, const float* ks, const float* kz, const int64_t* perm,
                          int64_t RT, int64_t D, bool target, IntQueries& out) {
  const float div = target ? 16.f : 1.f, off = target ? 8.f : 0.f;
  out.codes.resize(RT * D), out.step.resize(RT), out.bias.resize(RT);
  out.s.resize(D), out.z.resize(D), out.scaled.resize(D);
  for (int64_t d = 0; d < D; ++d) {
    out.s[d] = ks[perm[d]] / div;
    out.z[d] = kz[perm[d]] - off * out.s[d];
  }
  for (int64_t r = 0; r < RT; ++r) {
    const float* qr = q + r * D;
    for (int64_t d = 0; d < D; ++d) out.scaled[d] = qr[d] * out.s[d];
    out.step[r] = round_to_codes(out.scaled.data(), D, out.codes.data() + r * D);
    out.bias[r] = dot_fixed(qr, out.z.data(), D);
  }
}

// dots [RT, n]: sum over positions of codes[r] times the n tokens' bytes u, from the planes'
// rows up/lo [n, D/2] (lo: the lower plane, read by the target only).
template <bool TARGET>
inline void int_dots_portable(const uint8_t* up, const uint8_t* lo, int64_t n, int64_t D,
                              const int16_t* codes, int64_t RT, int32_t* dots) {
  const int64_t W = segment_width(D), hw = W / 2, half = D / 2;
  for (int64_t r = 0; r < RT; ++r) {
    const int16_t* c = codes + r * D;
    for (int64_t j = 0; j < n; ++j) {
      int64_t dot = 0;  // (exact in int32 for D <= kMaxIntQueryDim, which the caller checks)
      for (int64_t s = 0; s < D; s += W) {
        const uint8_t* u = up + j * half + s / 2;
        const uint8_t* l = lo + j * half + s / 2;
        for (int64_t b = 0; b < hw; ++b) {
          int32_t even = u[b] & 15, odd = u[b] >> 4;
          if (TARGET) even = 16 * even + (l[b] & 15), odd = 16 * odd + (l[b] >> 4);
          dot += int64_t(c[s + b]) * even + int64_t(c[s + hw + b]) * odd;
        }
      }
      dots[r * n + j] = int32_t(dot);
    }
  }
}

// int_dots_portable on the SIMD layer's attention ops A for head_dim DT (64 or 128): the
// block's bytes widened to int16 once, then A::kDotTokens tokens at a time per row.
template <class A, int64_t DT, bool TARGET>
void int_dots_vector(const uint8_t* up, const uint8_t* lo, int64_t n, const int16_t* codes,
                     int64_t RT, int32_t* dots) {
  constexpr int64_t HALF = DT / 2;  // bytes per token per plane
  using Vec = typename A::Words;
  constexpr int64_t TOK = A::kDotTokens, QV = DT * 2 / sizeof(Vec);
  const int64_t padded = (n + TOK - 1) / TOK * TOK;
  alignas(64) int16_t words[kMaxBlock * DT];  // n <= kMaxBlock tokens
  for (int64_t j = 0; j < n; ++j)
    for (int64_t s = 0; s < DT; s += 64)
      A::template segment_words<TARGET>(up + j * HALF + s / 2, lo + j * HALF + s / 2,
                                        words + j * DT + s);
  std::fill(words + n * DT, words + padded * DT, int16_t(0));
  for (int64_t r = 0; r < RT; ++r) {
    Vec qv[QV];
    for (int64_t v = 0; v < QV; ++v)
      std::memcpy(&qv[v], codes + r * DT + v * (sizeof(Vec) / 2), sizeof(Vec));
    for (int64_t j0 = 0; j0 < n; j0 += TOK)
      A::template row_dots<DT>(words + j0 * DT, qv, dots + r * n + j0,
                               std::min<int64_t>(TOK, n - j0));
  }
}

// Dispatch: the vector path for head_dim DT (64, 128) where the build has one (A::kVector), the
// portable one otherwise and for DT = 0.
template <int64_t DT, bool TARGET, class A = simd::Attn>
void int_dots(const uint8_t* up, const uint8_t* lo, int64_t n, int64_t D, const int16_t* codes,
              int64_t RT, int32_t* dots) {
  if constexpr (DT != 0 && A::kVector)
    int_dots_vector<A, DT, TARGET>(up, lo, n, codes, RT, dots);
  else
    int_dots_portable<TARGET>(up, lo, n, D, codes, RT, dots);
}

}  // namespace attn
