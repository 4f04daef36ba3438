// The draft's W4A8 linear (int_dot.h: the shared activation rounding, the NEON helpers, the
// W8A8 target's linear and the description of the paths). Torch-free: int_dot.cpp holds the
// torch entry point, the test driver in kernels/cpu/tests calls the core on raw pointers.
#pragma once
#include "int_dot.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace intdot {

// ------------------------------------------------------------------------------------ W4A8
// y = x W^T with W[n, k] = (q - z) s per group, q packed two per byte ([N, K/2], even k in
// the low nibble), s/z fp32 [N, K/G]. Per 64-input chunk c of row n:
//   sum_k (q - z) s xq dx = s dx (sum_k q xq - z sum_k xq).
// The zero-point term is summed per weight group from per-chunk step * sum(codes), computed
// once with the activations. The twin is `kernels.cpu.linear.int4_linear_ref` (the same
// activation rounding, then a dense matmul); this is the draft path only, whose output only
// proposes tokens.
struct QuantRows {  // x [M, K] -> per 64-chunk: even/odd int8 halves, step; per group: zsum
  std::vector<int8_t> even, odd;  // [M, C, 32]
  std::vector<float> step;        // [M, C]
  std::vector<float> step8;       // [M, C + 1, 8]: step broadcast 8 times, then 8 zeros
  std::vector<float> zsum;        // [M, K/G]: sum over the group's chunks of step * sum(codes)
};

inline QuantRows quantize_rows4(const float* x, int64_t M, int64_t K, int64_t G) {
  const int64_t C = K / CHUNK, per_group = G / CHUNK;
  QuantRows r{std::vector<int8_t>(M * C * 32), std::vector<int8_t>(M * C * 32),
              std::vector<float>(M * C), std::vector<float>(M * (C + 1) * 8, 0.f),
              std::vector<float>(M * (K / G), 0.f)};
  int8_t codes[CHUNK];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < C; ++c) {
      const float step = quantize_chunk(x + m * K + c * CHUNK, codes);
      int sum = 0;
      int8_t* even = &r.even[(m * C + c) * 32];
      int8_t* odd = &r.odd[(m * C + c) * 32];
      for (int i = 0; i < 32; ++i) {
        even[i] = codes[2 * i];
        odd[i] = codes[2 * i + 1];
        sum += codes[2 * i] + codes[2 * i + 1];
      }
      r.step[m * C + c] = step;
      for (int j = 0; j < 8; ++j) r.step8[(m * (C + 1) + c) * 8 + j] = step;
      r.zsum[m * (K / G) + c / per_group] += step * float(sum);
    }
  }
  return r;
}

// Zero-point terms and bias: out[m, n] = y - sum_g s z zsum[m, g] + b.
inline float int4_finish(float y, const QuantRows& xq, const float* scale, const float* zero,
                         const float* bias, int64_t m, int64_t n, int64_t NG) {
  const float* s = scale + n * NG;
  const float* z = zero + n * NG;
  for (int64_t g = 0; g < NG; ++g) y -= s[g] * z[g] * xq.zsum[m * NG + g];
  return bias ? y + bias[n] : y;
}

#if defined(QSPEC_AVX512_VNNI)
// Two chunks per 64-byte load: lanes 0-7 hold chunk c's partial dots, lanes 8-15 chunk c + 1's
// (the low nibbles against the even codes, the high against the odd, both in one int32 lane
// sum); an odd last chunk loads half, its upper lanes zero with a zero step.
template <int M, int NR>
inline void int4_block(const QuantRows& xq, const uint8_t* packed, const float* scale,
                       const float* zero, const float* bias, float* out, int64_t K, int64_t N,
                       int64_t G, int64_t n) {
  const int64_t C = K / CHUNK, NG = K / G, per_group = G / CHUNK;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[NR][M];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 2) {
    const __mmask64 bytes = c + 1 < C ? ~__mmask64(0) : __mmask64(0xFFFFFFFFull);
    const int64_t g0 = c / per_group, g1 = c + 1 < C ? (c + 1) / per_group : g0;
    __m512i lo[NR], hi[NR];
    __m512 sv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = packed + (n + r) * (K / 2) + c * 32;
      const __m512i b = _mm512_maskz_loadu_epi8(bytes, p);
      prefetch_ahead(p, NR * K / 2);
      lo[r] = _mm512_and_si512(b, mask);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
      const float* s = scale + (n + r) * NG;
      sv[r] = _mm512_insertf32x8(_mm512_set1_ps(s[g0]), _mm256_set1_ps(s[g1]), 1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m * C + c) * 32;
      const __m512i e = _mm512_maskz_loadu_epi8(bytes, &xq.even[at]);
      const __m512i o = _mm512_maskz_loadu_epi8(bytes, &xq.odd[at]);
      const __m512 step = _mm512_loadu_ps(&xq.step8[(m * (C + 1) + c) * 8]);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], e),
                                              hi[r], o);
        acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), step), sv[r], acc[r][m]);
      }
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      out[m * N + n + r] =
          int4_finish(_mm512_reduce_add_ps(acc[r][m]), xq, scale, zero, bias, m, n + r, NG);
}
template <int M>
constexpr int int4_nr() { return M <= 2 ? 4 : 2; }  // lo, hi, scales, sums: 4 NR + NR M zmm

#elif defined(QSPEC_AVX2)
// NR weight rows from n against M rows of x. Per 64-input chunk c and row pair (r, m):
// acc += s[r, g] * step[m, c] * sum_k q x_codes (vpmaddubsw: 32 nibbles (u8) times 32 codes,
// pairs added, exact: |pair| <= 2 * 15 * 127); the zero points after.
template <int M, int NR>
inline void int4_block(const QuantRows& xq, const uint8_t* packed, const float* scale,
                       const float* zero, const float* bias, float* out, int64_t K, int64_t N,
                       int64_t G, int64_t n) {
  const int64_t C = K / CHUNK, NG = K / G, per_group = G / CHUNK;
  const __m256i mask = _mm256_set1_epi8(0x0F);
#ifndef QSPEC_AVX_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[NR][M];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m256i lo[NR], hi[NR];
    __m256 sv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = packed + (n + r) * (K / 2) + c * 32;
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if (c % 2 == 0) prefetch_ahead(p, NR * K / 2);  // (a cache line is two chunks)
      lo[r] = _mm256_and_si256(b, mask);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      sv[r] = _mm256_set1_ps(scale[(n + r) * NG + c / per_group]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m * C + c) * 32;
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.even[at]));
      const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.odd[at]));
      const __m256 step = _mm256_broadcast_ss(&xq.step[m * C + c]);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
#ifdef QSPEC_AVX_VNNI
        const __m256i lanes = _mm256_dpbusd_avx_epi32(
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo[r], e), hi[r], o);
#else
        const __m256i lanes = _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], e), _mm256_maddubs_epi16(hi[r], o)),
            ones);
#endif
        const __m256 p = _mm256_cvtepi32_ps(lanes);
        acc[r][m] = _mm256_fmadd_ps(_mm256_mul_ps(p, step), sv[r], acc[r][m]);
      }
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      out[m * N + n + r] = int4_finish(hsum(acc[r][m]), xq, scale, zero, bias, m, n + r, NG);
}
template <int M>
constexpr int int4_nr() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

#elif defined(QSPEC_NEON)
// The AVX2 path's lanes as two int32x4 (lanes 0-3: packed bytes 0-15 of the chunk, 4-7: bytes
// 16-31; low nibbles against the even codes, high against the odd), the same fp32 vector
// operations (int4_finish's scalar ones may fuse differently: int_dot.h).
template <int M, int NR>
inline void int4_block(const QuantRows& xq, const uint8_t* packed, const float* scale,
                       const float* zero, const float* bias, float* out, int64_t K, int64_t N,
                       int64_t G, int64_t n) {
  const int64_t C = K / CHUNK, NG = K / G, per_group = G / CHUNK;
  const uint8x16_t mask = vdupq_n_u8(0x0F);
  const int32x4_t none = vdupq_n_s32(0);
  float32x4_t acc[NR][M][2];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = vdupq_n_f32(0.f);
  for (int64_t c = 0; c < C; ++c) {
    int8x16_t lo[NR][2], hi[NR][2];
    float32x4_t sv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = packed + (n + r) * (K / 2) + c * 32;
      for (int h = 0; h < 2; ++h) {
        const uint8x16_t b = vld1q_u8(p + 16 * h);
        lo[r][h] = vreinterpretq_s8_u8(vandq_u8(b, mask));
        hi[r][h] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
      }
      if (c % 2 == 0) prefetch_ahead(p, NR * K / 2);  // (a cache line is two chunks)
      sv[r] = vdupq_n_f32(scale[(n + r) * NG + c / per_group]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m * C + c) * 32;
      const int8x16_t e[2] = {vld1q_s8(&xq.even[at]), vld1q_s8(&xq.even[at + 16])};
      const int8x16_t o[2] = {vld1q_s8(&xq.odd[at]), vld1q_s8(&xq.odd[at + 16])};
      const float32x4_t step = vdupq_n_f32(xq.step[m * C + c]);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r)
        for (int h = 0; h < 2; ++h) {
          using simd::dot16;
          const int32x4_t lanes = dot16(dot16(none, lo[r][h], e[h]), hi[r][h], o[h]);
          acc[r][m][h] =
              vfmaq_f32(acc[r][m][h], vmulq_f32(vcvtq_f32_s32(lanes), step), sv[r]);
        }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      out[m * N + n + r] = int4_finish(simd::hsum(simd::F8{acc[r][m][0], acc[r][m][1]}), xq,
                                       scale, zero, bias, m, n + r, NG);
}
template <int M>
constexpr int int4_nr() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

#else
template <int M, int NR>
inline void int4_block(const QuantRows& xq, const uint8_t* packed, const float* scale,
                       const float* zero, const float* bias, float* out, int64_t K, int64_t N,
                       int64_t G, int64_t n) {
  const int64_t C = K / CHUNK, NG = K / G, per_group = G / CHUNK;
  for (int r = 0; r < NR; ++r) {
    const uint8_t* row = packed + (n + r) * (K / 2);
    for (int m = 0; m < M; ++m) {
      float y = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        int dot = 0;
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = row[c * 32 + i];
          dot += (byte & 15) * xq.even[(m * C + c) * 32 + i];
          dot += (byte >> 4) * xq.odd[(m * C + c) * 32 + i];
        }
        y += float(dot) * scale[(n + r) * NG + c / per_group] * xq.step[m * C + c];
      }
      out[m * N + n + r] = int4_finish(y, xq, scale, zero, bias, m, n + r, NG);
    }
  }
}
template <int M>
constexpr int int4_nr() { return 1; }
#endif

template <int M, class For>
void int4_pass(const QuantRows& xq, const uint8_t* packed, const float* scale, const float* zero,
               const float* bias, float* out, int64_t K, int64_t N, int64_t G,
               const For& parallel_for) {
  // NR weight rows share each activation load; the most for one row of x (a draft step)
  constexpr int NR = int4_nr<M>();
  parallel_for(0, (N + NR - 1) / NR, grain_rows(K / 2 * NR), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        int4_block<M, NR>(xq, packed, scale, zero, bias, out, K, N, G, n);
      } else {
        for (int64_t i = n; i < N; ++i)
          int4_block<M, 1>(xq, packed, scale, zero, bias, out, K, N, G, i);
      }
    }
  });
}

// out [M, N] = x [M, K] (M <= 8) times the 4-bit w: packed [N, K/2], scale/zero [N, K/G] fp32
// (W4A8), plus bias [N] (or null); K and G multiples of 64, G dividing K.
template <class For>
void int4_rows(const float* x, int64_t M, int64_t K, const uint8_t* packed, const float* scale,
               const float* zero, int64_t G, const float* bias, int64_t N, float* out,
               const For& parallel_for) {
  const QuantRows xq = quantize_rows4(x, M, K, G);
  const auto& f = parallel_for;
  switch (M) {
    case 1: int4_pass<1>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    case 2: int4_pass<2>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    case 3: int4_pass<3>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    case 4: int4_pass<4>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    case 5: int4_pass<5>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    case 6: int4_pass<6>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    case 7: int4_pass<7>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
    default: int4_pass<8>(xq, packed, scale, zero, bias, out, K, N, G, f); break;
  }
}

}  // namespace intdot
