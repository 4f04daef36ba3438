// The W8A8 target's prefill product, at the int8 peak: x [M, K] (M in the hundreds, a prompt
// chunk) rounded to int8 per 64 inputs, times int8 weights [N, K] with a scale per output.
//
//   y[m, n] = scale[n] * F[m, n] + bias[n],   F = sum over chunks c, in order, of
//             step[m, c] * I[m, n, c]          (one fp32 fused multiply-add per chunk)
//   I[m, n, c] = sum_{k in c} w[n, k] x_codes[m, k]   (exact: |I| <= 64 * 128 * 127 < 2^24)
//
// The step kernels (int_dot.h) sum each chunk's integer dot in 16 partial lanes of one output,
// convert and scale every lane, and reduce the lanes at the end: 3 vector operations per 64
// multiply-adds, a third of `vpdpbusd`'s rate. Here a vector's 16 lanes are 16 outputs, an
// activation's 4 codes are broadcast, and one `vpdpbusd` adds 4 multiply-adds to each lane, so
// a chunk's whole integer dot accumulates in one int32 lane and is converted once: per chunk and
// tile of 6 rows x 32 outputs, 192 `vpdpbusd` and 24 conversions and multiply-adds (~85% of
// the instruction rate goes to products). The prefill's numbers therefore differ from a decode
// step's by fp32 rounding (the step sums partial lanes); every output element is still one fixed
// sequence of operations on its own lane: the same whatever M, the tile or the thread count.
//
// The weights are packed per call, a slab of 32 outputs at a time, into the order the products
// read them: [K / 4][32][4] bytes, each weight + 128 (vpdpbusd multiplies unsigned bytes by
// signed ones; the chunk's integer lane then starts at -128 times the sum of its codes, so it
// ends exactly at sum w x). A slab is 32 K bytes (L2), packed once per unit of 128 rows it
// serves: a 1/256 overhead. AVX-512 VNNI only (`kAvailable`); elsewhere the step kernels'
// GEMM schedule (int_dot.h `w8a8_gemm`) runs many rows.
#pragma once
#include "int_dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace intgemm {

using intdot::CHUNK;

#if defined(QSPEC_AVX512_VNNI)
constexpr bool kAvailable = true;
#else
constexpr bool kAvailable = false;
#endif

constexpr int64_t LANES = 16;            // outputs per vector
constexpr int NV = 2;                    // vectors of outputs per tile
constexpr int64_t SLAB = LANES * NV;     // outputs per packed slab
constexpr int MR = 6;                    // x rows per tile: 12 int + 12 fp32 accumulators
constexpr int64_t ROW_BLOCK = 128;       // x rows per unit of work

// One weight of a product (`w8a8_prefill`): w [N, K] int8 with scale [N], bias [N] (or null),
// into out [M, N].
struct Part {
  const int8_t* w;
  const float* scale;
  const float* bias;
  int64_t N;
  float* out;
};

struct Codes {                  // x [M, K] rounded per chunk
  std::vector<int8_t> codes;    // [M, K]
  std::vector<float> step;      // [M, C]
  std::vector<int32_t> start;   // [M, C]: -128 * (sum of the chunk's codes)
};

template <class For>
Codes round_rows(const float* x, int64_t M, int64_t K, const For& parallel_for) {
  const int64_t C = K / CHUNK;
  Codes r{std::vector<int8_t>(M * K), std::vector<float>(M * C), std::vector<int32_t>(M * C)};
  parallel_for(0, M * C, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t mc = b0; mc < b1; ++mc) {
      int8_t* codes = &r.codes[mc * CHUNK];
      r.step[mc] = intdot::quantize_chunk(x + mc * CHUNK, codes);
      int32_t sum = 0;
      for (int64_t k = 0; k < CHUNK; ++k) sum += codes[k];
      r.start[mc] = -128 * sum;
    }
  });
  return r;
}

// Outputs [n0, n0 + SLAB) of w [N, K] -> packed [K / 4][SLAB][4], each byte w + 128 (rows past
// N: zero weights, their outputs never stored).
inline void pack_slab(const int8_t* w, int64_t N, int64_t K, int64_t n0, uint8_t* packed) {
  for (int64_t j = 0; j < SLAB; ++j) {
    const int64_t n = n0 + j;
    for (int64_t g = 0; g < K / 4; ++g)
      for (int i = 0; i < 4; ++i)
        packed[(g * SLAB + j) * 4 + i] = uint8_t(n < N ? w[n * K + 4 * g + i] : 0) ^ 0x80;
  }
}

#if defined(QSPEC_AVX512_VNNI)
// acc += w (unsigned bytes) . x (signed bytes), four products per int32 lane. GCC 12 compiles
// the intrinsic in this loop with two register copies around every vpdpbusd and spills the
// fp32 accumulators (61% of oneDNN's int8 GEMM rate on one Zen 5 core, 82% this way); the
// instruction with its accumulator tied in place compiles to the loop the tile means. Same
// instruction, same bits.
inline __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(w), "v"(x));  // (AT&T | Intel)
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, x);
#endif
}

// R rows of x from m against a packed slab: acc [R][NV] (16 outputs each) over every chunk.
template <int R>
inline void tile(const uint8_t* packed, const Codes& x, int64_t m, int64_t K, __m512 acc[][NV]) {
  const int64_t C = K / CHUNK;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i dot[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(x.start[(m + r) * C + c]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) dot[r][v] = start;
    }
    const uint8_t* wc = packed + c * (CHUNK / 4) * SLAB * 4;
    for (int64_t g = 0; g < CHUNK / 4; ++g) {
      __m512i wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(wc + (g * SLAB + v * LANES) * 4);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, &x.codes[(m + r) * K + c * CHUNK + 4 * g], 4);
        const __m512i xb = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) dot[r][v] = dpbusd(dot[r][v], wv[v], xb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 step = _mm512_set1_ps(x.step[(m + r) * C + c]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][v]), step, acc[r][v]);
    }
  }
}

// acc -> out rows [m, m + R), outputs [n0, min(N, n0 + SLAB)): scale, then bias.
template <int R>
inline void finish(const __m512 acc[][NV], const float* scale, const float* bias, float* out,
                   int64_t N, int64_t n0, int64_t m) {
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + v * LANES;
    if (n >= N) break;
    const __mmask16 keep = N - n >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(keep, scale + n);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 y = bias ? _mm512_fmadd_ps(acc[r][v], s, b) : _mm512_mul_ps(acc[r][v], s);
      _mm512_mask_storeu_ps(out + (m + r) * N + n, keep, y);
    }
  }
}

template <int R>
inline void rows_of_tile(const uint8_t* packed, const Codes& x, int64_t m, int64_t K,
                         const float* scale, const float* bias, float* out, int64_t N,
                         int64_t n0) {
  __m512 acc[R][NV];
  tile<R>(packed, x, m, K, acc);
  finish<R>(acc, scale, bias, out, N, n0, m);
}

// Rows [m0, m1) against one packed slab.
inline void rows_of_slab(const uint8_t* packed, const Codes& x, int64_t m0, int64_t m1,
                         int64_t K, const float* scale, const float* bias, float* out,
                         int64_t N, int64_t n0) {
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) rows_of_tile<MR>(packed, x, m, K, scale, bias, out, N, n0);
  switch (m1 - m) {
    case 5: rows_of_tile<5>(packed, x, m, K, scale, bias, out, N, n0); break;
    case 4: rows_of_tile<4>(packed, x, m, K, scale, bias, out, N, n0); break;
    case 3: rows_of_tile<3>(packed, x, m, K, scale, bias, out, N, n0); break;
    case 2: rows_of_tile<2>(packed, x, m, K, scale, bias, out, N, n0); break;
    case 1: rows_of_tile<1>(packed, x, m, K, scale, bias, out, N, n0); break;
    default: break;
  }
}

// Each part's out = x [M, K] (K % 64 == 0) W8A8 times its w, as the header defines it: x
// rounded once for all parts, and every part's slabs in one parallel region (a layer's q, k and
// v, or gate and up: the small k/v products alone ran at 60% of the big ones' rate). Each
// output is computed as by a product of its part alone. parallel_for(begin, end, grain, fn) as
// in int_dot.h.
template <class For>
void w8a8_parts(const float* x, int64_t M, int64_t K, const Part* parts, int64_t n_parts,
                const For& parallel_for) {
  const Codes xq = round_rows(x, M, K, parallel_for);
  std::vector<int64_t> first(n_parts + 1, 0);  // the parts' first slabs, in one numbering
  for (int64_t p = 0; p < n_parts; ++p) first[p + 1] = first[p] + (parts[p].N + SLAB - 1) / SLAB;
  const int64_t slabs = first[n_parts], blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  // units slab-major: a thread's consecutive units share a slab, packed once for them
  parallel_for(0, slabs * blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<uint8_t> packed(K * SLAB);
    int64_t packed_slab = -1, p = 0;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t s = u / blocks, b = u % blocks;
      while (s >= first[p + 1]) ++p;
      const Part& part = parts[p];
      const int64_t n0 = (s - first[p]) * SLAB;
      if (s != packed_slab) {
        pack_slab(part.w, part.N, K, n0, packed.data());
        packed_slab = s;
      }
      const int64_t m0 = b * ROW_BLOCK, m1 = std::min(M, m0 + ROW_BLOCK);
      rows_of_slab(packed.data(), xq, m0, m1, K, part.scale, part.bias, part.out, part.N, n0);
    }
  });
}
#endif

// A prefill's W8A8 products of one x: the definition above where the build has AVX-512 VNNI,
// else the step kernels' GEMM schedule per part (int_dot.h: a decode step's bits for every row).
template <class For>
void w8a8_prefill(const float* x, int64_t M, int64_t K, const Part* parts, int64_t n_parts,
                  const For& parallel_for) {
#if defined(QSPEC_AVX512_VNNI)
  w8a8_parts(x, M, K, parts, n_parts, parallel_for);
#else
  for (int64_t p = 0; p < n_parts; ++p) {
    const Part& part = parts[p];
    intdot::w8a8_gemm(x, M, K, part.w, part.scale, part.bias, part.N, part.out, parallel_for);
  }
#endif
}

}  // namespace intgemm
