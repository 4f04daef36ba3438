// Integer-dot linears for the few rows of a decode or verify step (CPU): the activations are
// rounded to int8 per 64 inputs (symmetric, step max|x| / 127, ties to even, as llama.cpp
// rounds them for its Q8 dot products and as `kernels.cpu.linear.quantize_activations` does),
// so that the inner products run on integers, 64 multiply-adds per instruction with VNNI.
//
//   w8a8_rows_cpu: the INT8 target twin (int8 w [N, K], fp32 scale [N]; W = scale[n] q) with
//     int8 activations, W8A8: y[m, n] = scale[n] sum_c step[m, c] (sum_{k in c} q x_codes) + b.
//   int4_rows_cpu: the draft's 4-bit twin (packed [N, K/2], scale/zero [N, K/G]), W4A8.
//
// A step reads every weight byte once, and these kernels turn that stream from fp32 arithmetic
// into integer arithmetic: the per-chunk integer dot is exact (|sum| <= 64 * 128 * 127 < 2^24,
// so its fp32 conversion is exact too), and only the per-chunk sum of step * dot is in floats,
// in chunk order, in lanes laid out by the instruction set alone. So a row's result depends
// neither on how many rows share the call nor on where the row sits: batch-invariant, what
// greedy QuantSpec == target-ar rests on (the result does differ between instruction sets:
// AVX-512, AVX2 = AVX-VNNI = NEON, portable).
//
// Paths: AVX-512 VNNI (vpdpbusd: u8 x s8, four products per int32 lane; the int8 weights are
// made unsigned by flipping the top bit, w + 128, and each lane starts at -128 times the sum of
// its four activation codes, so the lane sum is exactly sum q x); AVX2 (vpmaddubsw on |w| and
// x with w's sign, pairs then quads summed exactly), which with AVX-VNNI (256-bit vpdpbusd)
// computes the same integer lanes in fewer instructions (W8A8: the same bits, measured);
// NEON on aarch64 (sdot with dotprod, else widening multiplies), which computes the AVX2 path's
// integer lanes and vector float operations in the same order: W8A8 gives the AVX2 path's bits
// (kernels/cpu/tests checks it under emulation); W4A8 nearly, its zero-point terms being scalar
// code that the compiler fuses into multiply-adds as it sees fit per target (a few ulp apart);
// portable C++. K must be a multiple of 64;
// x is fp32 [M, K], at most kMaxStepRows rows (W8A8) or 8 (W4A8), out [M, N] fp32.
//
// This header holds the torch-free cores, W4A8's in int4_dot.h (int_dot.cpp: the torch entry
// points; the test driver in kernels/cpu/tests calls the cores on raw pointers).
#pragma once
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace intdot {


constexpr int64_t CHUNK = 64;  // inputs per activation step

// Rounds x[0, 64) to int8 codes; returns the step (kernels.h: round_to_codes).
inline float quantize_chunk(const float* x, int8_t* codes) {
  return round_to_codes(x, CHUNK, codes);
}

// ------------------------------------------------------------------------------------ W8A8
constexpr int64_t W8_BLOCK_ROWS = 8;  // rows of x per pass over the weights

struct Int8Rows {                // x [M, K] as codes
  std::vector<int8_t> codes;     // [M, K]
  std::vector<float> step;       // [M, C]
  std::vector<int32_t> offset;   // [M, C, 16]: -128 * (sum of codes 4j .. 4j + 3): the VNNI
                                 // lanes' start, undoing the weights' + 128
};

// y scale[n] + bias[n] as one fused multiply-add, always: left to the compiler (-ffast-math
// contracts when it sees fit), it fused in some instantiations of M and not in others, and a
// row's result then changed with the number of rows in the call.
inline float w8a8_finish(float y, const float* scale, const float* bias, int64_t n) {
  return bias ? std::fma(y, scale[n], bias[n]) : y * scale[n];
}

// x [M, K] rounded chunk by chunk (each chunk on its own: the split between threads changes
// nothing); parallel_for as in w8a8_rows, or `Serial` for a step's few rows.
template <class For>
Int8Rows quantize_rows8(const float* x, int64_t M, int64_t K, const For& parallel_for) {
  const int64_t C = K / CHUNK;
  Int8Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * C),
             std::vector<int32_t>(M * C * 16)};
  parallel_for(0, M * C, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t mc = b0; mc < b1; ++mc) {
      int8_t* codes = &r.codes[mc * CHUNK];
      r.step[mc] = quantize_chunk(x + mc * CHUNK, codes);
      for (int j = 0; j < 16; ++j) {
        const int s = codes[4 * j] + codes[4 * j + 1] + codes[4 * j + 2] + codes[4 * j + 3];
        r.offset[mc * 16 + j] = -128 * s;
      }
    }
  });
  return r;
}

struct Serial {  // a parallel_for that runs the whole range in this thread
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t, const F& fn) const {
    if (begin < end) fn(begin, end);
  }
};

// NR weight rows from n against x rows m0 .. m0 + M - 1, on the SIMD layer's int8 dot
// (simd.h: Dot64): per chunk, the exact integer lanes, converted, times the chunk's step,
// summed over chunks in order; then the ISA's one fixed reduction of the lanes.
template <int M, int NR>
inline void w8a8_block(const Int8Rows& xq, const int8_t* w, const float* scale,
                       const float* bias, float* out, int64_t K, int64_t N, int64_t n,
                       int64_t m0) {
  using Dot = simd::Dot64;
  const int64_t C = K / CHUNK;
  typename Dot::Acc acc[NR][M];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = Dot::zero();
  for (int64_t c = 0; c < C; ++c) {
    typename Dot::W wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const int8_t* p = w + (n + r) * K + c * CHUNK;
      wv[r] = Dot::load_w(p);
      prefetch_ahead(p, NR * K);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m0 + m) * C + c;
      const typename Dot::X xv = Dot::load_x(&xq.codes[at * CHUNK], &xq.offset[at * 16]);
      const typename Dot::Acc step = Dot::set1(xq.step[at]);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = Dot::fma_dot(wv[r], xv, step, acc[r][m]);
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      out[(m0 + m) * N + n + r] = w8a8_finish(Dot::sum(acc[r][m]), scale, bias, n + r);
    }
}
template <int M>
constexpr int w8a8_nr() { return simd::Dot64::nr<M>(); }

template <int M, class For>
void w8a8_pass(const Int8Rows& xq, const int8_t* w, const float* scale, const float* bias,
               float* out, int64_t K, int64_t N, int64_t m0, const For& parallel_for) {
  constexpr int NR = w8a8_nr<M>();
  parallel_for(0, (N + NR - 1) / NR, grain_rows(K * NR), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        w8a8_block<M, NR>(xq, w, scale, bias, out, K, N, n, m0);
      } else {
        for (int64_t i = n; i < N; ++i) w8a8_block<M, 1>(xq, w, scale, bias, out, K, N, i, m0);
      }
    }
  });
}

// out [M, N] = x [M, K] (M <= 17, K % 64 == 0) times w [N, K] int8 with scale [N] (W8A8), plus
// bias [N] (or null). parallel_for(begin, end, grain, fn) runs fn(b0, b1) over [begin, end) in
// pieces (at::parallel_for in the extension, one call in the test driver).
template <class For>
void w8a8_rows(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale,
               const float* bias, int64_t N, float* out, const For& parallel_for) {
  const Int8Rows xq = quantize_rows8(x, M, K, Serial{});  // (a step: too few rows to share)
  for (int64_t m0 = 0; m0 < M; m0 += W8_BLOCK_ROWS) {
    switch (std::min(W8_BLOCK_ROWS, M - m0)) {
      case 1: w8a8_pass<1>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      case 2: w8a8_pass<2>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      case 3: w8a8_pass<3>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      case 4: w8a8_pass<4>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      case 5: w8a8_pass<5>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      case 6: w8a8_pass<6>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      case 7: w8a8_pass<7>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
      default: w8a8_pass<8>(xq, w, scale, bias, out, K, N, m0, parallel_for); break;
    }
  }
}


// ------------------------------------------------------------------ W8A8, many rows (a prefill)
// The same blocks as w8a8_rows, so every output element is computed by the very instruction
// sequence a decode step runs for it (its own accumulator lanes, chunks in order, one fixed
// reduction): a prompt's rows come out bit for bit as decode steps compute them, whatever M.
// (With AVX-512 VNNI a prefill runs int_gemm.h instead: 3x fewer operations per product.)
// What changes is the schedule: the rows are rounded once (in parallel), and each thread takes
// a slab of weight rows and runs every W8_GEMM_ROWS-row block of x against it, so the weights
// are read once per call (not once per 8 rows) and the x block stays in L1 while the slab
// streams from L2. One parallel region per product, not one per 8 rows.
constexpr int64_t W8_GEMM_ROWS = 4;  // x rows per block: NR = w8a8_nr<4>() weight rows each
constexpr int64_t W8_GEMM_SLAB = 8;  // weight rows per unit of work: a multiple of every NR

// Weight rows [n0, n1) against x rows [m0, m0 + M).
template <int M>
inline void w8a8_span(const Int8Rows& xq, const int8_t* w, const float* scale, const float* bias,
                      float* out, int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t m0) {
  constexpr int NR = w8a8_nr<M>();
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) w8a8_block<M, NR>(xq, w, scale, bias, out, K, N, n, m0);
  for (; n < n1; ++n) w8a8_block<M, 1>(xq, w, scale, bias, out, K, N, n, m0);
}

// out [M, N] = x [M, K] (any M >= 1, K % 64 == 0) times w [N, K] int8 with scale [N], plus
// bias [N] (or null): w8a8_rows's results, bit for bit, scheduled for many rows.
template <class For>
void w8a8_gemm(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale,
               const float* bias, int64_t N, float* out, const For& parallel_for) {
  const Int8Rows xq = quantize_rows8(x, M, K, parallel_for);
  const int64_t slabs = (N + W8_GEMM_SLAB - 1) / W8_GEMM_SLAB;
  parallel_for(0, slabs, 1, [&](int64_t s0, int64_t s1) {
    const int64_t n0 = s0 * W8_GEMM_SLAB, n1 = std::min(N, s1 * W8_GEMM_SLAB);
    for (int64_t m0 = 0; m0 < M; m0 += W8_GEMM_ROWS) {
      switch (std::min(W8_GEMM_ROWS, M - m0)) {
        case 1: w8a8_span<1>(xq, w, scale, bias, out, K, N, n0, n1, m0); break;
        case 2: w8a8_span<2>(xq, w, scale, bias, out, K, N, n0, n1, m0); break;
        case 3: w8a8_span<3>(xq, w, scale, bias, out, K, N, n0, n1, m0); break;
        default: w8a8_span<4>(xq, w, scale, bias, out, K, N, n0, n1, m0); break;
      }
    }
  });
}

}  // namespace intdot
