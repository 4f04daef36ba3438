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
// AVX-512 VNNI: `vpdpwssd`; AVX2: `vpmaddwd`; both over the block's bytes widened to int16 once
// for all rows.
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
  int64_t d = 0;
  float sum = 0.f;
#if defined(QSPEC_AVX512_VNNI)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(QSPEC_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  sum = hsum(acc);
#endif
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

#ifdef QSPEC_AVX2
// A token's 64-dim segment (32 bytes per plane) -> its bytes u, deinterleaved, as int16 [64].
template <bool TARGET>
inline void segment_words(const uint8_t* up, const uint8_t* lo, int16_t* out) {
  __m256i even, odd;
  segment_bytes<TARGET>(up, lo, even, odd);
  const __m256i bytes[2] = {even, odd};
  for (int h = 0; h < 2; ++h) {
    __m256i* o = reinterpret_cast<__m256i*>(out + 32 * h);
    _mm256_storeu_si256(o, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes[h])));
    _mm256_storeu_si256(o + 1, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes[h], 1)));
  }
}

#ifdef QSPEC_AVX512_VNNI
// Eight vectors of [token 2i: 8 partial sums | token 2i + 1: 8] -> the 16 tokens' sums, in order.
inline __m512i reduce_pairs(const __m512i* v) {
  __m512i a[4], b[2];
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: (x0 + x2, y0 + y2, x1 + x3, y1 + y3)
    a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                            _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // per lane: the lane's sums of v[4k] .. v[4k + 3]
    b[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
                            _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
  // lanes 0 + 1 and 2 + 3: tokens 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15
  const __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88),
                                     _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  return _mm512_permutexvar_epi32(order, c);
}

// Dots of one row against 16 tokens' words w [16, DT] (rows past `left` hold zeros).
template <int64_t DT>
inline __m512i row_dots16(const int16_t* w, const __m512i* qv) {
  constexpr int64_t NV = DT / 32;  // 32 int16 per vector
  __m512i pairs[8];
  for (int64_t t = 0; t < 16; t += 2) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int64_t v = 0; v < NV; ++v) {
      a = _mm512_dpwssd_epi32(a, _mm512_loadu_si512(w + t * DT + 32 * v), qv[v]);
      b = _mm512_dpwssd_epi32(b, _mm512_loadu_si512(w + (t + 1) * DT + 32 * v), qv[v]);
    }  // two tokens' 16 partials -> [8 | 8]
    pairs[t / 2] = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44),
                                    _mm512_shuffle_i32x4(a, b, 0xEE));
  }
  return reduce_pairs(pairs);
}
#else
// Dots of one row against 8 tokens' words w [8, DT].
template <int64_t DT>
inline __m256i row_dots8(const int16_t* w, const __m256i* qv) {
  constexpr int64_t NV = DT / 16;  // 16 int16 per vector
  __m256i acc[8];
  for (int64_t t = 0; t < 8; ++t) {
    acc[t] = _mm256_setzero_si256();
    for (int64_t v = 0; v < NV; ++v)
      acc[t] = _mm256_add_epi32(
          acc[t], _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                        w + t * DT + 16 * v)),
                                    qv[v]));
  }
  const __m256i u0 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
  const __m256i u1 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]), _mm256_hadd_epi32(acc[6], acc[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}
#endif  // QSPEC_AVX512_VNNI

// int_dots_portable for head_dim DT (64 or 128): the block's bytes widened to int16 once, then
// 16 (AVX-512) or 8 (AVX2) tokens at a time per row.
template <int64_t DT, bool TARGET>
void int_dots_vector(const uint8_t* up, const uint8_t* lo, int64_t n, const int16_t* codes,
                     int64_t RT, int32_t* dots) {
  constexpr int64_t HALF = DT / 2;  // bytes per token per plane
#ifdef QSPEC_AVX512_VNNI
  constexpr int64_t TOK = 16, QV = DT / 32;
  using Vec = __m512i;
#else
  constexpr int64_t TOK = 8, QV = DT / 16;
  using Vec = __m256i;
#endif
  const int64_t padded = (n + TOK - 1) / TOK * TOK;
  alignas(64) int16_t words[kMaxBlock * DT];  // n <= kMaxBlock tokens
  for (int64_t j = 0; j < n; ++j)
    for (int64_t s = 0; s < DT; s += 64)
      segment_words<TARGET>(up + j * HALF + s / 2, lo + j * HALF + s / 2, words + j * DT + s);
  std::fill(words + n * DT, words + padded * DT, int16_t(0));
  for (int64_t r = 0; r < RT; ++r) {
    Vec qv[QV];
    for (int64_t v = 0; v < QV; ++v)
      std::memcpy(&qv[v], codes + r * DT + v * (sizeof(Vec) / 2), sizeof(Vec));
    for (int64_t j0 = 0; j0 < n; j0 += TOK) {
      const int64_t left = std::min<int64_t>(TOK, n - j0);
#ifdef QSPEC_AVX512_VNNI
      const __m512i sums = row_dots16<DT>(words + j0 * DT, qv);
      _mm512_mask_storeu_epi32(dots + r * n + j0, __mmask16((1u << left) - 1), sums);
#else
      alignas(32) int32_t tmp[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), row_dots8<DT>(words + j0 * DT, qv));
      std::copy(tmp, tmp + left, dots + r * n + j0);
#endif
    }
  }
}
#endif  // QSPEC_AVX2

// Dispatch: the vector path for head_dim DT (64, 128), the portable one for DT = 0.
template <int64_t DT, bool TARGET>
void int_dots(const uint8_t* up, const uint8_t* lo, int64_t n, int64_t D, const int16_t* codes,
              int64_t RT, int32_t* dots) {
#ifdef QSPEC_AVX2
  if constexpr (DT != 0) return int_dots_vector<DT, TARGET>(up, lo, n, codes, RT, dots);
#endif
  int_dots_portable<TARGET>(up, lo, n, D, codes, RT, dots);
}

}  // namespace attn
