// y = x W^T (+ b) for the few rows of a decode or verify step (M <= 17), for CPUs.
//
// A decode step is a stream over the weights: each weight row is read once from memory and
// used for every row of x, which sits in L1. PyTorch's GEMM for M = 2..8 does not stream
// like that here (a 5-token verify cost 1.8x a 1-token step on the same weights), so this
// kernel makes a verify of gamma + 1 tokens cost about what one token does.
//
// Batch invariance (what greedy QuantSpec == target-ar rests on): each output y[m, n] is
// computed by the same instructions in the same order whatever M is and wherever row m sits
// in x: eight fp32 lanes over K in steps of 8, one fixed horizontal sum, the K % 8 tail in
// order, then scale and bias. PyTorch's GEMMs pick other kernels, splits and reduction orders
// for M = 1 and M = 5 (bf16 and int8 on AVX-512 machines measurably), so a token's logits
// inside a verify would not be those of the same token decoded alone.
//
// Weights: fp32, bf16 or fp16 [N, K] (converted to fp32 in registers), or int8 [N, K] with
// an fp32 scale per row (W8, the INT8 target: y = scale[n] * sum_k x q + b). Activations are
// fp32 (callers upcast bf16/fp16 rows exactly). x [M, K] and W [N, K] row-major (stride 1
// along K); out [M, N] fp32. Rows of W are split over torch's thread pool, NR at a time, so
// that NR * M independent FMA chains hide the FMA latency; x goes in blocks of at most 8 rows.
//
// This header holds the torch-free core (linear.cpp: the torch entry points; the test driver in
// kernels/cpu/tests calls the core on raw pointers).
#pragma once
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace rowlinear {


constexpr int64_t MAX_BLOCK_ROWS = 8;  // rows of x per pass over the weights

// A weight type W's conversions: Weight<W>::f32(w), one weight as fp32 (the scalar tail and
// the portable path), and on the vector paths Weight<W>::load8(p), eight weights as fp32 lanes
// (Lanes8). Here for float and int8; linear.cpp adds torch's bf16 and fp16 through
// load8_bf16 / load8_fp16.
template <typename W>
struct Weight;

// y = s * scale + bias, the same expression for every row and every M.
inline float finish(float s, const float* scale, const float* bias, int64_t n) {
  if (scale) s *= scale[n];
  return bias ? s + bias[n] : s;
}

#if defined(QSPEC_AVX2)
using Lanes8 = __m256;
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_i8(const int8_t* p) {
  int64_t bits;
  std::memcpy(&bits, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}
inline __m256 load8_bf16(const uint16_t* p) {  // bf16 is the top half of an fp32
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline __m256 load8_fp16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif defined(QSPEC_NEON)
struct Lanes8 {  // the AVX2 path's eight lanes: 0-3, 4-7
  float32x4_t lo, hi;
};
inline Lanes8 load8_f32(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline Lanes8 load8_i8(const int8_t* p) {
  const int16x8_t h = vmovl_s8(vld1_s8(p));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_high_s16(h))};
}
inline Lanes8 load8_bf16(const uint16_t* p) {  // bf16 is the top half of an fp32
  const uint16x8_t u = vld1q_u16(p);
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(u), 16)),
          vreinterpretq_f32_u32(vshll_high_n_u16(u, 16))};
}
inline Lanes8 load8_fp16(const uint16_t* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
#endif

template <>
struct Weight<float> {
  static float f32(float w) { return w; }
#if defined(QSPEC_AVX2) || defined(QSPEC_NEON)
  static Lanes8 load8(const float* p) { return load8_f32(p); }
#endif
};
template <>
struct Weight<int8_t> {
  static float f32(int8_t w) { return static_cast<float>(w); }
#if defined(QSPEC_AVX2) || defined(QSPEC_NEON)
  static Lanes8 load8(const int8_t* p) { return load8_i8(p); }
#endif
};

#ifdef QSPEC_AVX2
// NR weight rows starting at n against the M rows of x.
template <int M, int NR, typename W>
inline void rows_avx2(const float* __restrict x, const W* __restrict w, int64_t K, int64_t N,
                      int64_t n, const float* scale, const float* bias, float* __restrict out) {
  __m256 acc[NR][M];  // (fully unrolled: every accumulator lives in a register)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = Weight<W>::load8(w + (n + r) * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) s += Weight<W>::f32(w[(n + r) * K + k]) * x[m * K + k];
      out[m * N + n + r] = finish(s, scale, bias, n + r);
    }
  }
}

#endif  // QSPEC_AVX2

#ifdef QSPEC_NEON
// rows_avx2 in two float32x4 per accumulator: the same fused multiply-adds per lane, the same
// horizontal sum and tail, so the AVX2 path's bits.
template <int M, int NR, typename W>
inline void rows_neon(const float* __restrict x, const W* __restrict w, int64_t K, int64_t N,
                      int64_t n, const float* scale, const float* bias, float* __restrict out) {
  float32x4_t acc[NR][M][2];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = vdupq_n_f32(0.f);
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    Lanes8 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = Weight<W>::load8(w + (n + r) * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float32x4_t xlo = vld1q_f32(x + m * K + k), xhi = vld1q_f32(x + m * K + k + 4);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        acc[r][m][0] = vfmaq_f32(acc[r][m][0], wv[r].lo, xlo);
        acc[r][m][1] = vfmaq_f32(acc[r][m][1], wv[r].hi, xhi);
      }
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float32x4_t s4 = vaddq_f32(acc[r][m][0], acc[r][m][1]);
      const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
      float s = vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
      for (int64_t k = K8; k < K; ++k) s += Weight<W>::f32(w[(n + r) * K + k]) * x[m * K + k];
      out[m * N + n + r] = finish(s, scale, bias, n + r);
    }
  }
}
#endif  // QSPEC_NEON

#if defined(QSPEC_AVX2) || defined(QSPEC_NEON)
template <int M, typename W, class For>
void block_vector(const float* x, const W* w, const float* scale, const float* bias, float* out,
                  int64_t K, int64_t N, const For& parallel_for) {
  constexpr int NR = M == 1 ? 8 : M == 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
  const int64_t row_bytes = int64_t(sizeof(W)) * K * NR;
  parallel_for(0, (N + NR - 1) / NR, grain_rows(row_bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
#ifdef QSPEC_AVX2
        rows_avx2<M, NR>(x, w, K, N, n, scale, bias, out);
#else
        rows_neon<M, NR>(x, w, K, N, n, scale, bias, out);
#endif
      } else {
#ifdef QSPEC_AVX2
        for (int64_t i = n; i < N; ++i) rows_avx2<M, 1>(x, w, K, N, i, scale, bias, out);
#else
        for (int64_t i = n; i < N; ++i) rows_neon<M, 1>(x, w, K, N, i, scale, bias, out);
#endif
      }
    }
  });
}

// x rows [0, M) (M <= 8) against all of W; out rows have stride N.
template <typename W, class For>
void block(const float* x, const W* w, const float* scale, const float* bias, float* out,
           int64_t M, int64_t K, int64_t N, const For& parallel_for) {
  switch (M) {
    case 1: return block_vector<1>(x, w, scale, bias, out, K, N, parallel_for);
    case 2: return block_vector<2>(x, w, scale, bias, out, K, N, parallel_for);
    case 3: return block_vector<3>(x, w, scale, bias, out, K, N, parallel_for);
    case 4: return block_vector<4>(x, w, scale, bias, out, K, N, parallel_for);
    case 5: return block_vector<5>(x, w, scale, bias, out, K, N, parallel_for);
    case 6: return block_vector<6>(x, w, scale, bias, out, K, N, parallel_for);
    case 7: return block_vector<7>(x, w, scale, bias, out, K, N, parallel_for);
    default: return block_vector<8>(x, w, scale, bias, out, K, N, parallel_for);
  }
}
#else
// Portable: the same order for every row (eight partial sums over K, summed pairwise), so
// the result does not depend on M here either. (-ffast-math may vectorize this loop, but the
// loop and so the order are the same for every row.)
template <typename W, class For>
void block(const float* x, const W* w, const float* scale, const float* bias, float* out,
           int64_t M, int64_t K, int64_t N, const For& parallel_for) {
  parallel_for(0, N, grain_rows(int64_t(sizeof(W)) * K), [&](int64_t n0, int64_t n1) {
    const int64_t K8 = K & ~int64_t(7);
    for (int64_t n = n0; n < n1; ++n) {
      const W* wr = w + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t k = 0; k < K8; k += 8)
          for (int j = 0; j < 8; ++j) lane[j] += Weight<W>::f32(wr[k + j]) * xr[k + j];
        float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                  ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        for (int64_t k = K8; k < K; ++k) s += Weight<W>::f32(wr[k]) * xr[k];
        out[m * N + n] = finish(s, scale, bias, n);
      }
    }
  });
}
#endif

// out [M, N] = x [M, K] W^T (times scale [N] if given) + bias [N] (if given), W [N, K] of type
// W; parallel_for as in int_dot.h (at::parallel_for in the extension).
template <typename W, class For>
void rows(const float* x, const W* w, const float* scale, const float* bias, float* out,
          int64_t M, int64_t K, int64_t N, const For& parallel_for) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_BLOCK_ROWS)
    block(x + m0 * K, w, scale, bias, out + m0 * N, std::min(MAX_BLOCK_ROWS, M - m0), K, N,
          parallel_for);
}

}  // namespace rowlinear
