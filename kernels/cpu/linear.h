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

// A weight type W's conversions: Weight<W>::f32(w), one weight as fp32 (the scalar tail), and
// Weight<W>::load8(p), eight weights as fp32 lanes (simd::F8). Here for float and int8;
// linear_torch.h adds torch's bf16 and fp16 (simd::load8_bf16 / load8_fp16).
template <typename W>
struct Weight;

// y = s * scale + bias, the same expression for every row and every M.
inline float finish(float s, const float* scale, const float* bias, int64_t n) {
  if (scale) s *= scale[n];
  return bias ? s + bias[n] : s;
}

template <>
struct Weight<float> {
  static float f32(float w) { return w; }
  static simd::F8 load8(const float* p) { return simd::load8(p); }
};
template <>
struct Weight<int8_t> {
  static float f32(int8_t w) { return static_cast<float>(w); }
  static simd::F8 load8(const int8_t* p) { return simd::load8(p); }
};

// The tail's sum one term at a time, as written: -ffast-math lets GCC vectorize a short
// reduction loop, and GCC 12 did so for fp32 weights on AVX2 (pairwise sums) but not for bf16
// ones, so a bf16 copy's step gave other bits than its fp32 weight (tests/test_kernel_table.py).
inline void in_order(float& s) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(s));
#elif defined(__GNUC__) && defined(__aarch64__) && defined(__ARM_NEON)
  asm("" : "+w"(s));
#endif
}

// NR weight rows starting at n against the M rows of x: eight fp32 lanes per accumulator
// (simd::F8 on AVX2 and NEON; AVX-512 builds sum in eight lanes too), one fixed horizontal sum,
// the K % 8 tail in order.
template <int M, int NR, typename W>
inline void rows_block(const float* __restrict x, const W* __restrict w, int64_t K, int64_t N,
                       int64_t n, const float* scale, const float* bias, float* __restrict out) {
  simd::F8 acc[NR][M];  // (fully unrolled: every accumulator lives in a register)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = simd::zero8();
  const int64_t K8 = K & ~int64_t(7);
  constexpr int64_t kLine = 64 / int64_t(sizeof(W));  // weights per cache line
  for (int64_t k = 0; k < K8; k += 8) {
    simd::F8 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = Weight<W>::load8(w + (n + r) * K + k);
    // (the rows two blocks ahead, a line at a time: a 5-row verify's pass from memory ran
    // at 14-16 GB/s without this, 24-30 with it, Zen 4; the sums are untouched)
    if (k % kLine == 0) {
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r)
        prefetch_ahead(w + (n + r) * K + k, NR * K * int64_t(sizeof(W)));
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const simd::F8 xv = simd::load8(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = simd::fma(wv[r], xv, acc[r][m]);
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float s = simd::hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) {
        s += Weight<W>::f32(w[(n + r) * K + k]) * x[m * K + k];
        in_order(s);
      }
      out[m * N + n + r] = finish(s, scale, bias, n + r);
    }
  }
}

// Weight rows per block against M rows of x. With 32 registers (AVX-512VL: ymm16-31), as many
// as leave room for the weights, an x vector and a few temporaries (at most 8; 4, 3, 3, 2 for
// 5-8 rows: at most 25 registers): a verify of 2-4 rows ran at a third of the FMA rate with 8
// accumulator chains, and at 1.2-1.5x that with 15-16 (Zen 4, fp32 weights from memory and
// from L2); 5-8 rows of bf16 weights from memory 1-4% faster than with the table (Zen 5,
// inside that VM's noise; the bits are the same either way).
// With 16 registers, the table measured before (more chains ran slower there). The order of
// each output's sum, hence its bits, does not depend on NR.
template <int M>
constexpr int block_rows() {
  if constexpr (simd::kF8Registers >= 32) {
    constexpr int fit = (simd::kF8Registers - 6) / (M + 1);
    return fit > 8 ? 8 : fit;
  }
  return M == 1 ? 8 : M == 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
}

template <int M, typename W, class For>
void block_vector(const float* x, const W* w, const float* scale, const float* bias, float* out,
                  int64_t K, int64_t N, const For& parallel_for) {
  constexpr int NR = block_rows<M>();
  const int64_t row_bytes = int64_t(sizeof(W)) * K * NR;
  parallel_for(0, (N + NR - 1) / NR, grain_rows(row_bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        rows_block<M, NR>(x, w, K, N, n, scale, bias, out);
      } else {
        for (int64_t i = n; i < N; ++i) rows_block<M, 1>(x, w, K, N, i, scale, bias, out);
      }
    }
  });
}

// x rows [0, M) (M <= 8) against all of W; out rows have stride N.
template <typename W, class For>
void block(const float* x, const W* w, const float* scale, const float* bias, float* out,
           int64_t M, int64_t K, int64_t N, const For& parallel_for) {
  if constexpr (simd::kVectorF8) {
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
  } else {
    // Portable builds keep their own loop (and its bits: -ffast-math vectorizes it its own
    // way): the same order for every row (eight partial sums over K, summed pairwise), so the
    // result does not depend on M here either.
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
}

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
