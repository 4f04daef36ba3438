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

// NR weight rows from n against M rows of x, on the SIMD layer's W4A8 dot (simd::Int4, I):
// per step of I::kChunks 64-input chunks from c and row pair (r, m),
//   acc += s[r, g] * step[m, c] * sum_k q x_codes
// (the chunk's lanes as I orders them); the zero points after.
template <int M, int NR>
inline void int4_block(const QuantRows& xq, const uint8_t* packed, const float* scale,
                       const float* zero, const float* bias, float* out, int64_t K, int64_t N,
                       int64_t G, int64_t n) {
  using I = simd::Int4;
  const int64_t C = K / CHUNK, NG = K / G, per_group = G / CHUNK;
  typename I::Acc acc[NR][M];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = I::zero();
  for (int64_t c = 0; c < C; c += I::kChunks) {
    const bool two = c + 1 < C;  // (two chunks a step: whether the second exists)
    const int64_t g0 = c / per_group, g1 = two ? (c + 1) / per_group : g0;
    typename I::W w[NR];
    typename I::S sv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = packed + (n + r) * (K / 2) + c * 32;
      w[r] = I::load_w(p, two);
      if (c % 2 == 0) prefetch_ahead(p, NR * K / 2);  // (a cache line is two chunks)
      sv[r] = I::scales(scale + (n + r) * NG, g0, g1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t at = (m * C + c) * 32;
      const typename I::X x = I::load_x(&xq.even[at], &xq.odd[at], two);
      const typename I::Step step =
          I::load_step(&xq.step[m * C + c], &xq.step8[(m * (C + 1) + c) * 8]);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = I::fma_dot(w[r], x, step, sv[r], acc[r][m]);
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      out[m * N + n + r] = int4_finish(I::sum(acc[r][m]), xq, scale, zero, bias, m, n + r, NG);
}
template <int M>
constexpr int int4_nr() { return simd::Int4::nr<M>(); }

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
