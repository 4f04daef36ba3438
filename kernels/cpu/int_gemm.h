// The W8A8 target's prefill product, at the int8 peak: x [M, K] (M in the hundreds, a prompt
// chunk) rounded to int8 per 64 inputs, times int8 weights [N, K] with a scale per output.
//
//   y[m, n] = scale[n] * F[m, n] + bias[n],   F = sum over chunks c, in order, of
//             step[m, c] * I[m, n, c]          (one fp32 fused multiply-add per chunk)
//   I[m, n, c] = sum_{k in c} w[n, k] x_codes[m, k]   (exact: |I| <= 64 * 128 * 127 < 2^24)
//
// The step kernels (int_dot.h) sum each chunk's integer dot in partial lanes of one output,
// convert and scale every lane, and reduce the lanes at the end: 3 vector operations per
// product instruction. Here a vector's lanes are as many outputs, an activation's few codes are
// broadcast, and one product instruction adds them into each lane, so a chunk's whole integer
// dot accumulates in one int32 lane and is converted once: per chunk and tile of MR rows x NV
// vectors of outputs (6 x 2 with 32 registers; 4 x 2 with AVX-VNNI and 3 x 3 with vpmaddwd on
// 16), MR NV products per broadcast group and MR NV conversions and multiply-adds per chunk. The integer lanes are exact and the float
// operations are the definition's, so every instruction set computes the same bits
// (`w8a8_prefill_ref`); they differ from a decode step's by fp32 rounding (the step sums
// partial lanes). Every output element is one fixed sequence of operations on its own lane:
// the same whatever M, the tile or the thread count.
//
// The product instruction, per instruction set (`Form`):
//   AVX-512 VNNI  vpdpbusd zmm: 16 outputs, 4 inputs per lane and instruction (u8 x s8: each
//                 weight + 128, the lane starting at -128 times the sum of the 4 codes, so it
//                 ends exactly at sum w x)
//   AVX-VNNI      vpdpbusd ymm: the same on 8 outputs
//   AVX2          vpmaddwd ymm on int16 weights and codes (2 inputs per lane and instruction,
//                 exact) then vpaddd: 16 multiply-adds per 2 instructions, twice fp32's FMA.
//                 (vpmaddubsw would saturate on w + 128 and needs a sign per (row, vector)
//                 otherwise: 4 instructions per 32 multiply-adds, no fewer.)
// Elsewhere (NEON, portable) `kAvailable` is false and the step kernels' GEMM schedule
// (int_dot.h `w8a8_gemm`) runs many rows.
//
// The weights are packed per call, a slab of NV vectors of outputs at a time, into the order the
// products read them: [K / STEP][SLAB][STEP] (STEP the inputs per lane and instruction), packed
// once per unit of 128 rows it serves (a 1/256 overhead; a slab is at most 36 K in L2).
#pragma once
#include "int_dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace intgemm {

using intdot::CHUNK;

#if defined(QSPEC_AVX512_VNNI)
// vpdpbusd on 512 bits. GCC 12 compiles its intrinsic in the tile's loop with two register
// copies around every instruction and spills the fp32 accumulators (61% of oneDNN's int8 GEMM
// rate on one Zen 5 core, 82% this way); the instruction with its accumulator tied in place
// compiles to the loop the tile means. Same instruction, same bits.
struct Form {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t LANES = 16;  // outputs per vector
  static constexpr int STEP = 4;        // inputs per lane and product instruction
  static constexpr int MR = 6;          // x rows per tile: 12 int + 12 fp32 accumulators
  static constexpr int NV = 2;          // vectors of outputs per tile
  using Code = int8_t;                  // x's codes as the products read them
  using Packed = uint8_t;               // the packed weights: w + 128
  static Packed pack(int8_t w) { return uint8_t(w) ^ 0x80; }
  static int32_t start(int32_t sum_of_codes) { return -128 * sum_of_codes; }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I load(const Packed* p) { return _mm512_loadu_si512(p); }
  // dot[v] += the products of w[v] with the S codes at x, broadcast (v < NV)
  template <int N>
  static void row(I* dot, const I* w, const Code* x) {
    static_assert(N == NV);
    int32_t group;
    std::memcpy(&group, x, 4);
    const I xb = _mm512_set1_epi32(group);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
#if defined(__GNUC__) && !defined(__clang__)
      asm("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(dot[v]) : "v"(w[v]), "v"(xb));
#else
      dot[v] = _mm512_dpbusd_epi32(dot[v], w[v], xb);
#endif
    }
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F fma_dot(I dot, float step, F acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(step), acc);
  }
  // lanes [0, count) of p, zeros past them (count <= LANES); stores of lanes [0, count)
  static __mmask16 keep(int64_t count) {
    return count >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  }
  static F load_part(const float* p, int64_t count) {
    return _mm512_maskz_loadu_ps(keep(count), p);
  }
  static void store_part(float* p, F y, int64_t count) {
    _mm512_mask_storeu_ps(p, keep(count), y);
  }
  static F scaled(F acc, F scale, F bias, bool has_bias) {  // acc * scale (+ bias, fused)
    return has_bias ? _mm512_fmadd_ps(acc, scale, bias) : _mm512_mul_ps(acc, scale);
  }
};
#elif defined(QSPEC_AVX2)
struct Form {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t LANES = 8;
#if defined(QSPEC_AVX_VNNI)
  static constexpr int STEP = 4;  // vpdpbusd ymm: as on AVX-512, 8 outputs
  using Code = int8_t;
  using Packed = uint8_t;
  static Packed pack(int8_t w) { return uint8_t(w) ^ 0x80; }
  static int32_t start(int32_t sum_of_codes) { return -128 * sum_of_codes; }
#else
  static constexpr int STEP = 2;  // vpmaddwd: pairs of int16 products, exact, into int32
  using Code = int16_t;
  using Packed = int16_t;
  static Packed pack(int8_t w) { return w; }
  static int32_t start(int32_t) { return 0; }
#endif
  // The tile: MR rows x NV vectors of outputs. With vpmaddwd, 3 x 3 (9 int accumulators, 3
  // weight vectors, a broadcast, a product: 14 of the 16 registers) issues the products at 148
  // GOP/s a Zen 3 core against 92 for 4 x 2, the shape VNNI keeps: per product pair 1/3 of a
  // broadcast instead of 1/2, and the broadcasts share the integer pipes with vpaddd (a
  // torch-free loop of the tile alone, one core; the pipes' own bound, vpmaddwd + vpaddd
  // pairs, is 164). Every shape computes the same bits.
#if defined(QSPEC_AVX_VNNI)
  static constexpr int MR = 4, NV = 2;  // 8 int accumulators, 2 weight vectors, a broadcast
#else
  static constexpr int MR = 3, NV = 3;
#endif
  // dot[v] += the products of w[v] with the codes at x, broadcast. One asm block per row: as
  // intrinsics GCC 12 loaded every row's broadcast first and, 16 registers short, spilled the
  // integer accumulators in the inner loop (MR 6: 202 GOP/s; this way: see PERF.md).
  template <int N>
  static void row(I* dot, const I* w, const Code* x) {
    static_assert(N == NV);
#if defined(__GNUC__) && !defined(__clang__)
    I b;
#if defined(QSPEC_AVX_VNNI)
    asm("vpbroadcastd %[x], %[b]\n\t"
        "%{vex%} vpdpbusd %[b], %[w0], %[d0]\n\t"
        "%{vex%} vpdpbusd %[b], %[w1], %[d1]"
        : [d0] "+x"(dot[0]), [d1] "+x"(dot[1]), [b] "=&x"(b)
        : [w0] "x"(w[0]), [w1] "x"(w[1]), [x] "m"(*reinterpret_cast<const int32_t*>(x)));
#else
    I t;
    asm("vpbroadcastd %[x], %[b]\n\t"
        "vpmaddwd %[b], %[w0], %[t]\n\t"
        "vpaddd %[t], %[d0], %[d0]\n\t"
        "vpmaddwd %[b], %[w1], %[t]\n\t"
        "vpaddd %[t], %[d1], %[d1]\n\t"
        "vpmaddwd %[b], %[w2], %[t]\n\t"
        "vpaddd %[t], %[d2], %[d2]"
        : [d0] "+x"(dot[0]), [d1] "+x"(dot[1]), [d2] "+x"(dot[2]), [b] "=&x"(b), [t] "=&x"(t)
        : [w0] "x"(w[0]), [w1] "x"(w[1]), [w2] "x"(w[2]),
          [x] "m"(*reinterpret_cast<const int32_t*>(x)));
#endif
#else
    int32_t group;
    std::memcpy(&group, x, 4);
    const I xb = _mm256_set1_epi32(group);
    for (int v = 0; v < NV; ++v) {
#if defined(QSPEC_AVX_VNNI)
      dot[v] = _mm256_dpbusd_avx_epi32(dot[v], w[v], xb);
#else
      dot[v] = _mm256_add_epi32(dot[v], _mm256_madd_epi16(w[v], xb));
#endif
    }
#endif
  }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I load(const Packed* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static F zero() { return _mm256_setzero_ps(); }
  static F fma_dot(I dot, float step, F acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(step), acc);
  }
  static I keep(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(count)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load_part(const float* p, int64_t count) { return _mm256_maskload_ps(p, keep(count)); }
  static void store_part(float* p, F y, int64_t count) { _mm256_maskstore_ps(p, keep(count), y); }
  static F scaled(F acc, F scale, F bias, bool has_bias) {
    return has_bias ? _mm256_fmadd_ps(acc, scale, bias) : _mm256_mul_ps(acc, scale);
  }
};
#endif

#if defined(QSPEC_AVX2)
constexpr bool kAvailable = true;
#else
constexpr bool kAvailable = false;
#endif

// One weight of a product (`w8a8_prefill`): w [N, K] int8 with scale [N], bias [N] (or null),
// into out [M, N].
struct Part {
  const int8_t* w;
  const float* scale;
  const float* bias;
  int64_t N;
  float* out;
};

#if defined(QSPEC_AVX2)
constexpr int NV = Form::NV;                   // vectors of outputs per tile
constexpr int64_t SLAB = Form::LANES * NV;     // outputs per packed slab
constexpr int64_t ROW_BLOCK = 128;             // x rows per unit of work

struct Codes {                      // x [M, K] rounded per chunk
  std::vector<Form::Code> codes;    // [M, K]
  std::vector<float> step;          // [M, C]
  std::vector<int32_t> start;       // [M, C]: each chunk's integer lanes' start (Form::start)
};

template <class For>
Codes round_rows(const float* x, int64_t M, int64_t K, const For& parallel_for) {
  const int64_t C = K / CHUNK;
  Codes r{std::vector<Form::Code>(M * K), std::vector<float>(M * C),
          std::vector<int32_t>(M * C)};
  parallel_for(0, M * C, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t mc = b0; mc < b1; ++mc) {
      int8_t bytes[CHUNK];  // (int8 codes: rounded in place)
      int8_t* codes = std::is_same_v<Form::Code, int8_t>
                          ? reinterpret_cast<int8_t*>(&r.codes[mc * CHUNK]) : bytes;
      r.step[mc] = intdot::quantize_chunk(x + mc * CHUNK, codes);
      int32_t sum = 0;
      for (int64_t k = 0; k < CHUNK; ++k) sum += codes[k];
      r.start[mc] = Form::start(sum);
      if constexpr (!std::is_same_v<Form::Code, int8_t>)
        for (int64_t k = 0; k < CHUNK; ++k) r.codes[mc * CHUNK + k] = bytes[k];
    }
  });
  return r;
}

// Outputs [n0, n0 + SLAB) of w [N, K] -> packed [K / STEP][SLAB][STEP] (rows past N: zero
// weights, their outputs never stored).
inline void pack_slab(const int8_t* w, int64_t N, int64_t K, int64_t n0, Form::Packed* packed) {
  constexpr int S = Form::STEP;
  for (int64_t j = 0; j < SLAB; ++j) {
    const int64_t n = n0 + j;
    for (int64_t g = 0; g < K / S; ++g)
      for (int i = 0; i < S; ++i)
        packed[(g * SLAB + j) * S + i] = Form::pack(n < N ? w[n * K + S * g + i] : 0);
  }
}

// R rows of x from m against a packed slab: acc [R][NV] (LANES outputs each) over every chunk.
template <int R>
inline void tile(const Form::Packed* packed, const Codes& x, int64_t m, int64_t K,
                 Form::F acc[][NV]) {
  constexpr int S = Form::STEP;
  const int64_t C = K / CHUNK;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Form::zero();
  for (int64_t c = 0; c < C; ++c) {
    Form::I dot[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Form::I start = Form::set1(x.start[(m + r) * C + c]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) dot[r][v] = start;
    }
    const Form::Packed* wc = packed + c * (CHUNK / S) * SLAB * S;
    for (int64_t g = 0; g < CHUNK / S; ++g) {
      Form::I wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) wv[v] = Form::load(wc + (g * SLAB + v * Form::LANES) * S);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        Form::row<NV>(dot[r], wv, &x.codes[(m + r) * K + c * CHUNK + S * g]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[r][v] = Form::fma_dot(dot[r][v], x.step[(m + r) * C + c], acc[r][v]);
  }
}

// acc -> out rows [m, m + R), outputs [n0, min(N, n0 + SLAB)): scale, then bias.
template <int R>
inline void rows_of_tile(const Form::Packed* packed, const Codes& x, int64_t m, int64_t K,
                         const float* scale, const float* bias, float* out, int64_t N,
                         int64_t n0) {
  Form::F acc[R][NV];
  tile<R>(packed, x, m, K, acc);
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + v * Form::LANES;
    if (n >= N) break;
    const int64_t count = std::min<int64_t>(Form::LANES, N - n);
    const Form::F s = Form::load_part(scale + n, count);
    const Form::F b = bias ? Form::load_part(bias + n, count) : Form::zero();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      Form::store_part(out + (m + r) * N + n, Form::scaled(acc[r][v], s, b, bias), count);
  }
}

// Rows [m0, m1) against one packed slab.
inline void rows_of_slab(const Form::Packed* packed, const Codes& x, int64_t m0, int64_t m1,
                         int64_t K, const float* scale, const float* bias, float* out,
                         int64_t N, int64_t n0) {
  constexpr int MR = Form::MR;
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
    std::vector<Form::Packed> packed(K * SLAB);
    int64_t packed_slab = -1, p = 0;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t s = u / blocks, b = u % blocks;
      while (s >= first[p + 1]) ++p;
      const int64_t n0 = (s - first[p]) * SLAB;
      if (s != packed_slab) {
        pack_slab(parts[p].w, parts[p].N, K, n0, packed.data());
        packed_slab = s;
      }
      const int64_t m0 = b * ROW_BLOCK, m1 = std::min(M, m0 + ROW_BLOCK);
      const Part& part = parts[p];
      rows_of_slab(packed.data(), xq, m0, m1, K, part.scale, part.bias, part.out, part.N, n0);
    }
  });
}
#endif

// A prefill's W8A8 products of one x: the definition above where the build has a `Form`, else
// the step kernels' GEMM schedule per part (int_dot.h: a decode step's bits for every row).
template <class For>
void w8a8_prefill(const float* x, int64_t M, int64_t K, const Part* parts, int64_t n_parts,
                  const For& parallel_for) {
#if defined(QSPEC_AVX2)
  w8a8_parts(x, M, K, parts, n_parts, parallel_for);
#else
  for (int64_t p = 0; p < n_parts; ++p) {
    const Part& part = parts[p];
    intdot::w8a8_gemm(x, M, K, part.w, part.scale, part.bias, part.N, part.out, parallel_for);
  }
#endif
}

}  // namespace intgemm
