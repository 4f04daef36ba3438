// Causal attention of a prefill chunk over everything before it, tiled (flash attention on a
// CPU): no [T, S] score matrix, the keys read in blocks of KB against tiles of query rows,
// an online softmax per row. The prefill's attention is most of its FLOPs at long contexts
// (2 T S D per layer and head for scores and values), and torch's SDPA ran it at 40-50
// GFLOP/s on two Zen 4 cores (docs/PERF.md), a quarter of their fp32 FMA peak.
//
//   q [H, T, D] (a batch item's heads), k/v rows [n_kv, S, D] (GQA: head h reads kv head
//   h / (H / n_kv)), out [H, T, D]; query t sits at position start + t and sees keys
//   0 .. start + t, or under a sliding window W (a local layer's) the W keys up to its own,
//   start + t - W + 1 .. start + t; Gemma 2's scores are soft-capped first (`ScoreRule`).
//   fp32 throughout, D a multiple of 16.
//
// The arithmetic is plain fp32 in one fixed order per row (scores as 64-term dot products
// summed over d in order, the softmax folded block by block in key order, exp by a fixed
// polynomial), so a row's result does not depend on the thread count or on which rows share
// its tile. It differs from SDPA's by rounding only (the tests hold them to 1e-5).
//
// Written on GCC/Clang vector extensions one register wide (L fp32 lanes: 16 in a zmm with
// AVX-512, 8 in a ymm with AVX or AVX2, 4 in a NEON q or SSE xmm register), so one source serves
// every instruction set; the tile sizes follow the register file. (A 16-lane vector on AVX2 was
// lowered through the stack, lane by lane: the AVX2 build ran 65x slower than the AVX-512 one
// and 15-20x slower than torch's SDPA, docs/PERF.md.) Torch-free: flash_prefill.cpp is the
// entry point.
#pragma once
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

// (vf by value in inline helpers: GCC's note that such a vector's ABI differs without AVX-512
// concerns calls between translation units, which inline helpers never make)
#pragma GCC diagnostic ignored "-Wpsabi"

namespace flash {

// L fp32 lanes: one register of the widest vectors this build has
#if defined(__AVX512F__)
#define QSPEC_FLASH_LANES 16
#elif defined(__AVX__)
#define QSPEC_FLASH_LANES 8
#else
#define QSPEC_FLASH_LANES 4  // (NEON, SSE2; plain C++ lowers it to scalars elsewhere)
#endif
constexpr int L = QSPEC_FLASH_LANES;
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

constexpr int64_t QB = 32;  // query rows per unit of work (a thread's tile rows)
#if defined(__AVX512F__)
constexpr int NV = 4;  // vectors of L keys per key block (KB = 64 keys)
constexpr int ST = 4;  // rows per score tile: 4 x 4 accumulators + 4 key vectors of 32 zmm
constexpr int RG = 4;  // rows per value group at D = 64: 4 x D/L accumulators (16 zmm)
#elif defined(__aarch64__)
constexpr int NV = 8;  // 32 q registers: 2 x 8 accumulators + 8 key vectors (KB = 32 keys)
constexpr int ST = 2;
constexpr int RG = 1;  // (unused: the value sums take kColumns vectors at a time)
#else
constexpr int NV = 4;  // 16 ymm (or xmm): 3 x 4 accumulators, the key vectors as operands
constexpr int ST = 3;
constexpr int RG = 1;  // (unused: kColumns)
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif
// Builds with vectors narrower than 16 lanes take a row group's value sums a few vectors of the
// rows at a time (`Fp32::value_columns`): kColumns vectors of kColumnRows rows. All of a row at
// once held 8 accumulator chains at D = 64 with AVX2, too few for the FMA units' latency, and
// its vectors were operands read once each: 2 vectors of 4 rows (8 chains, the 2 vectors in
// registers, a broadcast a row) ran the fp32 kernel 1.25x as fast on Zen 5 (docs/PERF.md).
// The sums are the same, in the same order, so are the bits.
constexpr int kColumns = kRegisters == 16 ? 2 : 4;
constexpr int kColumnRows = 4;  // (at most 4: Rows::p has 4 rows past QB)
constexpr int64_t KB = L * NV;  // keys per block: the softmax folds a block at a time
// Heads of one kv head a unit may take (`unit_heads`), and the bytes of keys and values a
// unit's heads take in turn (`span_blocks`): half of the smallest L2 of the CPUs we run on
// (1 MB a core: Zen 4), beside the heads' rows (19 KB each at D = 64).
constexpr int64_t kMaxUnitHeads = 8;
constexpr int64_t kSpanBytes = 512 * 1024;
// Key blocks in a unit's span, for a block of `block_bytes` (keys and values as laid out).
inline int64_t span_blocks(int64_t block_bytes) {
  return std::max<int64_t>(1, kSpanBytes / block_bytes);
}

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
// A vector the compiler must hold in a register: a key or value vector is used by every row
// of a tile, and folded into each multiply-add as a memory operand it is loaded once per row.
inline vf in_register(const vf& in) {
  vf v = in;
#if defined(__GNUC__) && (defined(__AVX__) || defined(__SSE2__))
  asm("" : "+v"(v));
#elif defined(__GNUC__) && defined(__aarch64__) && defined(__ARM_NEON)
  asm("" : "+w"(v));
#endif
  return v;
}
// v with its lanes exchanged in pairs of runs of w (w = L/2, ..., 2, 1): the steps of a tree
// reduction. (The scalar loop over 16 lanes it replaces was a 16-long dependency chain in
// every row's fold: with the sum's, a third of the fold's time in perf.)
inline vf exchange(const vf& v, int w) {
#if defined(__clang__) || __GNUC__ >= 12
#define QSPEC_SHUFFLE(...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define QSPEC_SHUFFLE(...) __builtin_shuffle(v, vi{__VA_ARGS__})
#endif
#if QSPEC_FLASH_LANES == 16
  switch (w) {
    case 8: return QSPEC_SHUFFLE(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    case 4: return QSPEC_SHUFFLE(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    case 2: return QSPEC_SHUFFLE(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    default: return QSPEC_SHUFFLE(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
#elif QSPEC_FLASH_LANES == 8
  switch (w) {
    case 4: return QSPEC_SHUFFLE(4, 5, 6, 7, 0, 1, 2, 3);
    case 2: return QSPEC_SHUFFLE(2, 3, 0, 1, 6, 7, 4, 5);
    default: return QSPEC_SHUFFLE(1, 0, 3, 2, 5, 4, 7, 6);
  }
#else
  return w == 2 ? QSPEC_SHUFFLE(2, 3, 0, 1) : QSPEC_SHUFFLE(1, 0, 3, 2);
#endif
#undef QSPEC_SHUFFLE
}
inline float hmax(vf v) {
  for (int w = L / 2; w >= 1; w /= 2) {
    const vf o = exchange(v, w);
    v = v > o ? v : o;
  }
  return v[0];
}
inline float hsum(vf v) {
  for (int w = L / 2; w >= 1; w /= 2) v += exchange(v, w);
  return v[0];
}

// exp(x) for x <= 0 (-inf and anything below -87 give 0): n = round(x / ln 2), then
// 2^n times a degree-6 polynomial on the remainder (the Cephes coefficients of exp512 in
// attention_math.h). Rounding by truncation of x log2(e) - 1/2, exact for x <= 0, since
// -ffast-math may fold the usual add-and-subtract-a-magic-number trick away.
inline vf exp_nonpositive(const vf& in) {
  const vi dead = in < -87.0f;
  const vf x = dead ? splat(-87.0f) : in;
  const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);
  const vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return dead ? splat(0.f) : y * scale;
}

// tanh(x) lane by lane (Gemma 2's soft cap, cap tanh(s / cap)): Cephes' tanhf, an odd
// polynomial below |x| = 0.625 and (1 - e) / (1 + e), e = exp(-2 |x|), above (no cancellation
// there: e <= 0.29). Within a few fp32 ulps of std::tanh; NaN stays NaN.
inline vf tanh_lanes(const vf& x) {
  const vf a = x < 0.f ? -x : x;
  const vf z = x * x;
  vf poly = splat(-5.70498872745e-3f);
  poly = poly * z + 2.06390887954e-2f;
  poly = poly * z - 5.37397155531e-2f;
  poly = poly * z + 1.33314422036e-1f;
  poly = poly * z - 3.33332819422e-1f;
  const vf small = poly * z * x + x;
  const vf e = exp_nonpositive(-2.f * a);
  const vf big = (1.f - e) / (1.f + e);
  return a < 0.625f ? small : (x < 0.f ? -big : big);
}

// What a row's scores go through beside the causal bound: a local layer's sliding window
// (query at p sees keys p - window + 1 .. p; 0: none) and Gemma 2's soft cap of the scaled
// scores (s -> softcap tanh(s / softcap); 0: none).
struct ScoreRule {
  int64_t window = 0;
  float softcap = 0.f;
};

// Keys [S, D] -> blocks [ceil(S / KB), D, KB] (key j of a block in lane j; zeros past S), so
// a row's KB scores are D multiply-adds of a broadcast query element by NV vectors.
inline void transpose_keys(const float* k, int64_t S, int64_t D, float* kt) {
  const int64_t blocks = (S + KB - 1) / KB;
  for (int64_t b = 0; b < blocks; ++b) {
    float* out = kt + b * D * KB;
    const int64_t n = std::min(KB, S - b * KB);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < n; ++j) out[d * KB + j] = k[(b * KB + j) * D + d];
      for (int64_t j = n; j < KB; ++j) out[d * KB + j] = 0.f;
    }
  }
}

// The online softmax of a score tile's rows t0 .. t0 + ST - 1 (those below `rows`) over the
// block of keys from k0: caps the scores under rule.softcap, masks the keys past each row's
// position (and, under a sliding rule.window, those at or below its position - window), sets
// p[r] = exp(s - new max) and rescales the row's running max m, sum l and the factor alpha
// its accumulator takes. l is kept per lane ([L] a row) and summed across lanes once, in
// `write`.
inline void fold(vf sc[ST][NV], int64_t t0, int64_t rows, int64_t pos0, int64_t k0,
                 const ScoreRule& rule, float (*p)[KB], float* m, vf* l, float* alpha) {
  const int64_t window = rule.window;
  for (int i = 0; i < ST && t0 + i < rows; ++i) {
    const int64_t r = t0 + i, last = pos0 + r;  // this row's newest visible key
    if (rule.softcap != 0.f) {  // (before the mask, as the reference caps the scaled scores)
      const float inv = 1.f / rule.softcap;
      for (int c = 0; c < NV; ++c) sc[i][c] = tanh_lanes(sc[i][c] * inv) * rule.softcap;
    }
    if (k0 + KB - 1 > last) {
      for (int c = 0; c < NV; ++c)
        for (int j = 0; j < L; ++j)
          if (k0 + L * c + j > last) sc[i][c][j] = -INFINITY;
    }
    if (window && k0 <= last - window) {  // (its oldest visible key: last - window + 1)
      for (int c = 0; c < NV; ++c)
        for (int j = 0; j < L; ++j)
          if (k0 + L * c + j <= last - window) sc[i][c][j] = -INFINITY;
    }
    vf top = sc[i][0];
    for (int c = 1; c < NV; ++c) top = top > sc[i][c] ? top : sc[i][c];
    const float mx = std::max(m[r], hmax(top));  // (-inf: no key of the row seen yet)
    if (mx == -INFINITY) {  // (a block wholly below the row's window, before any it sees: as
      std::fill(p[r], p[r] + KB, 0.f);  // if skipped, so a row's bits do not depend on which
      alpha[r] = 1.f;                   // rows share its tile)
      continue;
    }
    const vf vmx = splat(mx);
    vf sum = vf{};
    for (int c = 0; c < NV; ++c) {
      const vf e = exp_nonpositive(sc[i][c] - vmx);
      store(p[r] + L * c, e);
      sum += e;
    }
    if (mx == m[r]) {  // (most blocks after the first few: exp(0) = 1, the same bits cheaper)
      alpha[r] = 1.f;
      l[r] += sum;
      continue;
    }
    const vf a = exp_nonpositive(splat(m[r]) - vmx);  // (0 for the first block: m = -inf)
    alpha[r] = a[0];
    l[r] = l[r] * a + sum;
    m[r] = mx;
  }
}

// A head's rows in a unit: their output sums, the current block's probabilities, each row's
// running softmax max and sum and the factor its sums take at a block's fold; `write`
// normalizes. (19 KB at D = 64: L1 while its head works through a span of blocks.)
template <int64_t D>
struct Rows {
  alignas(64) float acc[QB][D];
  alignas(64) float p[QB + 4][KB];  // (+ 4: a value group of 3 rows may run past QB)
  vf l[QB];  // each row's softmax sum, per lane
  float m[QB], alpha[QB];
  Rows() {
    for (auto& row : p) std::fill(row, row + KB, 0.f);  // (rows past `rows` stay zeros)
    for (int64_t i = 0; i < QB; ++i) {
      std::fill(acc[i], acc[i] + D, 0.f);
      m[i] = -INFINITY;
      l[i] = vf{};
      alpha[i] = 0.f;
    }
  }
  void write(int64_t rows, float* out) const {
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = 1.f / hsum(l[i]);
      for (int64_t d = 0; d < D; ++d) out[i * D + d] = acc[i][d] * inv;
    }
  }
};

// The fp32 products: keys [blocks][D][KB] (transpose_keys), values the rows [S, D] as they
// are (a block's: D KB floats from key k0's row).
struct Fp32 {
  using E = float;  // the queries' and keys' element type
  using V = float;  // the values'
  struct Context {};  // (what a unit's products need beside its operands: nothing here)
  Fp32() = default;
  explicit Fp32(const Context&) {}
  void head(int64_t) {}  // (the unit's head h is next: nothing to switch)
  void finish(float*, int64_t, int64_t) const {}  // (a head's output rows are final as written)
  // A score tile's sc[i] += q_i . keys of the block kb: q the tile's rows [ST, D], from the
  // head's row t0.
  template <int64_t D>
  static void scores(const float* q, int64_t, const float* kb, vf (&sc)[ST][NV]) {
    for (int64_t d = 0; d < D; ++d) {
      vf kd[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        kd[c] = load(kb + d * KB + L * c);
        // (held where the tile leaves registers for them; else operands of the multiply-adds)
        if constexpr (ST * NV + NV + 1 <= kRegisters) kd[c] = in_register(kd[c]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < ST; ++i) {
        const float qd = q[i * D + d];
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) sc[i][c] += qd * kd[c];
      }
    }
  }
  void probabilities(const float (*)[KB], int64_t) {}  // (the values take p as it is)
  // Vectors c0 .. c0 + VC - 1 of a row group's sums: a[i][c] += p_{r0 + i} V[:, c0 + c]
  // over the block's nk keys vb [nk, D] (the builds of `kColumns`).
  template <int64_t D, int G, int VC>
  void value_columns(vf (&a)[G][VC], int64_t r0, int c0, int64_t nk, const float* vb,
                     const float (*p)[KB]) const {
    for (int64_t j = 0; j < nk; ++j) {
      const float* vj = vb + j * D + c0 * L;
      vf vv[VC];
#pragma GCC unroll 8
      for (int c = 0; c < VC; ++c) vv[c] = load(vj + L * c);
#pragma GCC unroll 8
      for (int i = 0; i < G; ++i) {
        const float pij = p[r0 + i][j];  // (rows past `rows`: zeros, never stored)
#pragma GCC unroll 8
        for (int c = 0; c < VC; ++c) a[i][c] += pij * vv[c];
      }
    }
  }
  // A value group's a[i] += p_{r0 + i} V over the block's nk keys vb [nk, D].
  template <int64_t D, int G>
  void values(vf (&a)[G][D / L], int64_t r0, int64_t nk, const float* vb,
              const float (*p)[KB]) const {
    constexpr int DV = D / L;
    for (int64_t j = 0; j < nk; ++j) {
      const float* vj = vb + j * D;
      vf vv[DV];
#pragma GCC unroll 8
      for (int c = 0; c < DV; ++c) vv[c] = in_register(load(vj + L * c));
#pragma GCC unroll 8
      for (int i = 0; i < G; ++i) {
        const float pij = p[r0 + i][j];  // (rows past `rows`: zeros, never stored)
#pragma GCC unroll 8
        for (int c = 0; c < DV; ++c) a[i][c] += pij * vv[c];
      }
    }
  }
};

// One block of KB keys from k0 for one head's rows (`unit`): their scores, the softmax fold,
// the value sums.
template <int DV, class P>
__attribute__((always_inline)) inline void block(Rows<L * DV>& s, P& products,
                                                 const typename P::E* q, const typename P::E* kb,
                                                 const typename P::V* vb, int64_t k0,
                                                 int64_t rows, int64_t pos0,
                                                 const ScoreRule& rule) {
  constexpr int64_t D = L * DV;
  auto& acc = s.acc;
  float* alpha = s.alpha;
  const int64_t end = pos0 + rows;
  for (int64_t t0 = 0; t0 < rows; t0 += ST) {
    vf sc[ST][NV];
#pragma GCC unroll 8
    for (int i = 0; i < ST; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) sc[i][c] = vf{};
    products.template scores<D>(q + t0 * D, t0, kb, sc);
    fold(sc, t0, rows, pos0, k0, rule, s.p, s.m, s.l, alpha);
  }
  products.probabilities(s.p, rows);
  // acc = alpha acc + p V over the block's keys, G rows at a time (RG for D = 64; fewer for
  // wider heads, whose rows take more registers)
  const int64_t nk = std::min(KB, end - k0);
  if constexpr (L < 16) {  // (a few vectors of a few rows at a time: kColumns)
    static_assert(DV % kColumns == 0);
    for (int64_t r0 = 0; r0 < rows; r0 += kColumnRows)
      for (int c0 = 0; c0 < DV; c0 += kColumns) {
        vf a[kColumnRows][kColumns];
        for (int i = 0; i < kColumnRows; ++i)
          for (int c = 0; c < kColumns; ++c)
            a[i][c] = r0 + i < rows ? load(acc[r0 + i] + L * (c0 + c)) * alpha[r0 + i] : vf{};
        products.template value_columns<D, kColumnRows, kColumns>(a, r0, c0, nk, vb, s.p);
        for (int i = 0; i < kColumnRows && r0 + i < rows; ++i)
          for (int c = 0; c < kColumns; ++c) store(acc[r0 + i] + L * (c0 + c), a[i][c]);
      }
  } else {  // (whole rows, G at a time: `values`, which the 8-lane int16 products lack)
    constexpr int G = RG * 64 / D > 0 ? RG * 64 / D : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += G) {
      vf a[G][DV];
      for (int i = 0; i < G; ++i)
        for (int c = 0; c < DV; ++c)
          a[i][c] = r0 + i < rows ? load(acc[r0 + i] + L * c) * alpha[r0 + i] : vf{};
      products.template values<D, G>(a, r0, nk, vb, s.p);
      for (int i = 0; i < G && r0 + i < rows; ++i)
        for (int c = 0; c < DV; ++c) store(acc[r0 + i] + L * c, a[i][c]);
    }
  }
}

// `block` as a call, for the unit's walk over spans and heads: inlined in that loop nest, GCC
// 12's code ran the bf16 products 15-25% slower (measured, not traced); as a call, they run
// at least as fast as before the grouping on GQA shapes (docs/PERF.md).
template <int DV, class P>
__attribute__((noinline)) void block_call(Rows<L * DV>& s, P& products, const typename P::E* q,
                                          const typename P::E* kb, const typename P::V* vb,
                                          int64_t k0, int64_t rows, int64_t pos0,
                                          const ScoreRule& rule) {
  block<DV>(s, products, q, kb, vb, k0, rows, pos0, rule);
}

// One unit: query rows [r0, r0 + rows) (rows <= QB) of `heads` heads sharing a kv head
// (heads <= kMaxUnitHeads) against key blocks up to the last row's position, on the products
// P (Fp32, bf16::Products of flash_bf16.h or int16::Products of flash_int16.h), made from its
// Context ctx: P gives the element types E of the queries and keys and V of the values as
// laid out for it, a score tile's dot products, the block's probabilities as its value
// products take them, and a value group's sums; `head(h)` tells it which head's rows come
// next, `finish` takes a head's written rows to their final values. The tiles, the fold and
// the fp32 accumulators are the same for all. The blocks are taken a span at a time
// (`span_blocks`: about half of L2), every head through the span before the next: the span is
// read from memory once for all heads, and a head's rows stay in L1 while it works. (With one
// head a unit, a long prompt's history was streamed from memory once per head, and the fp32
// kernel ran 20% slower after 16k-32k tokens than after 8k: docs/PERF.md.) Each row's
// arithmetic is the same, in the same order, whatever heads share its unit. qs: head i's rows
// pre-scaled by 1/sqrt(D) at qs + i QB D [QB, D] (rows past `rows` zero); kt, v: the kv
// head's keys and values as P lays them out, D KB entries a block of KB keys; out: head i's
// rows [rows, D] at out + i head_stride. Under a sliding window (rule.window) the blocks below
// the first row's window are not read: a local layer's chunk reads about window + QB keys.
template <int DV, class P>
void unit(const typename P::Context& ctx, const typename P::E* qs, int64_t rows, int64_t heads,
          int64_t pos0, const ScoreRule& rule, const typename P::E* kt, const typename P::V* v,
          float* out, int64_t head_stride) {
  using E = typename P::E;
  constexpr int64_t D = L * DV;
  std::vector<Rows<D>> state(heads);
  P products(ctx);  // (a block's probabilities as its value products take them: a head at a time)
  const int64_t blocks = (pos0 + rows + KB - 1) / KB;  // keys [0, pos0 + rows) exist
  const int64_t first = rule.window ? std::max<int64_t>(0, pos0 - rule.window + 1) / KB : 0;
  if (heads == 1) {  // (one head: its blocks in one loop, `block` inlined)
    products.head(0);
    for (int64_t b = first; b < blocks; ++b)
      block<DV>(state[0], products, qs, kt + b * D * KB, v + b * D * KB, b * KB, rows, pos0,
                rule);
  } else {
    const int64_t span = span_blocks(D * KB * (sizeof(E) + sizeof(typename P::V)));
    for (int64_t b0 = first; b0 < blocks; b0 += span)
      for (int64_t h = 0; h < heads; ++h) {
        products.head(h);
        for (int64_t b = b0; b < std::min(blocks, b0 + span); ++b)
          block_call<DV>(state[h], products, qs + h * QB * D, kt + b * D * KB, v + b * D * KB,
                         b * KB, rows, pos0, rule);
      }
  }
  for (int64_t h = 0; h < heads; ++h) {
    state[h].write(rows, out + h * head_stride);
    products.finish(out + h * head_stride, rows, D);
  }
}

// Head dims with a compiled unit (D = L DV).
// (256: Gemma 2 and 3's heads; a row's sums take 32 KB there, about L1)
inline bool supported(int64_t D) {
  return D == 64 || D == 80 || D == 96 || D == 128 || D == 256;
}

template <class P>
inline void run_unit(int64_t D, const typename P::Context& ctx, const typename P::E* qs,
                     int64_t rows, int64_t heads, int64_t pos0, const ScoreRule& rule,
                     const typename P::E* kt, const typename P::V* v, float* out,
                     int64_t head_stride) {
  switch (D) {
    case 64: unit<64 / L, P>(ctx, qs, rows, heads, pos0, rule, kt, v, out, head_stride); break;
    case 80: unit<80 / L, P>(ctx, qs, rows, heads, pos0, rule, kt, v, out, head_stride); break;
    case 96: unit<96 / L, P>(ctx, qs, rows, heads, pos0, rule, kt, v, out, head_stride); break;
    case 128:
      unit<128 / L, P>(ctx, qs, rows, heads, pos0, rule, kt, v, out, head_stride);
      break;
    default:
      unit<256 / L, P>(ctx, qs, rows, heads, pos0, rule, kt, v, out, head_stride);
      break;
  }
}

// Heads a unit takes (`unit`): the most of a kv head's `group` that divide it, at most
// kMaxUnitHeads, and leave at least `min_units` units (n_kv * group / heads * q_blocks) for
// the threads to share, where one head a unit would give that many.
inline int64_t unit_heads(int64_t group, int64_t n_kv, int64_t q_blocks, int64_t min_units) {
  for (int64_t h = std::min(group, kMaxUnitHeads); h > 1; --h)
    if (group % h == 0 && n_kv * (group / h) * q_blocks >= min_units) return h;
  return 1;
}

}  // namespace flash
#include "flash_bf16.h"  // (the bf16 products: after the helpers they share)
namespace flash {

// The products a prefill's attention runs on: all fp32 (Fp32), all bf16 (bf16::Products),
// fp32 scores with bf16 value sums (bf16::ValueProducts), or int16 (int16::Products). What
// each rounds: flash_bf16.h, flash_int16.h.
enum class Operands { kFp32, kBf16, kBf16Values, kInt16 };

// One batch item: q [H, T, D] (contiguous) at positions start .. start + T - 1 over the rows
// of k/v (kv head g's row j at k + g * head_stride + j D, for j < start + T), under `rule`
// (a sliding window, a soft cap) -> out [H, T, D], on the products P, in at least min_units
// units where the heads allow (`unit_heads`: about 4 a thread keeps the threads' shares even).
// parallel_for(begin, end, grain, fn) as in int_dot.h.
template <class P, class For>
void causal_on(const float* q, int64_t H, int64_t T, int64_t D, const float* k, const float* v,
               int64_t n_kv, int64_t head_stride, int64_t start, const ScoreRule& rule, float* out,
               int64_t min_units, const For& parallel_for) {
  using E = typename P::E;  // the queries' and keys' element type
  using V = typename P::V;  // the values'
  constexpr bool kBf16Keys = std::is_same_v<E, uint16_t>, kBf16Values = std::is_same_v<V, uint16_t>;
  const int64_t group = H / n_kv, end = start + T, key_blocks = (end + KB - 1) / KB;
  const int64_t per_head = key_blocks * D * KB;
  // each kv head's keys (and bf16 values) laid out for the unit, once per call
  std::vector<E> kt(n_kv * per_head);
  std::vector<V> vt(kBf16Values ? n_kv * per_head : 0);
  parallel_for(0, n_kv, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if constexpr (kBf16Keys)
        bf16::pair_keys(k + g * head_stride, end, D, kt.data() + g * per_head);
      else
        transpose_keys(k + g * head_stride, end, D, kt.data() + g * per_head);
      if constexpr (kBf16Values)
        bf16::pair_values(v + g * head_stride, end, D, vt.data() + g * per_head);
    }
  });
  const float scale = 1.f / std::sqrt(float(D));
  const int64_t q_blocks = (T + QB - 1) / QB;
  const int64_t heads = unit_heads(group, n_kv, q_blocks, min_units), subs = group / heads;
  // units (kv head, its heads' share, block of QB rows), kv-head-major: each thread's share
  // holds early and late blocks of a causal chunk alike
  parallel_for(0, n_kv * subs * q_blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<E> qs(heads * QB * D);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / (subs * q_blocks), h0 = g * group + (u / q_blocks) % subs * heads;
      const int64_t r0 = (u % q_blocks) * QB, rows = std::min(QB, T - r0);
      std::fill(qs.begin(), qs.end(), E{});
      for (int64_t i = 0; i < heads; ++i) {
        const float* qp = q + ((h0 + i) * T + r0) * D;
        E* qi = qs.data() + i * QB * D;
        if constexpr (kBf16Keys) {
          for (int64_t j = 0; j < rows * D; ++j) qi[j] = bf16::round(qp[j] * scale);
        } else {
          for (int64_t j = 0; j < rows * D; ++j) qi[j] = qp[j] * scale;
        }
      }
      const V* values;  // (bf16: paired; fp32: the rows as they are)
      if constexpr (kBf16Values)
        values = vt.data() + g * per_head;
      else
        values = v + g * head_stride;
      run_unit<P>(D, typename P::Context{}, qs.data(), rows, heads, start + r0, rule,
                  kt.data() + g * per_head, values, out + (h0 * T + r0) * D, T * D);
    }
  });
}

}  // namespace flash
#include "flash_int16.h"  // (the int16 products: after causal_on's helpers they share)
namespace flash {

// Operands kBf16 and kBf16Values need bf16::kAvailable, kInt16 int16::kAvailable (the caller
// checks; elsewhere: fp32).
template <class For>
void causal(const float* q, int64_t H, int64_t T, int64_t D, const float* k, const float* v,
            int64_t n_kv, int64_t head_stride, int64_t start, const ScoreRule& rule, float* out,
            Operands operands, int64_t min_units, const For& parallel_for) {
  if constexpr (bf16::kAvailable) {
    if (operands == Operands::kBf16)
      return causal_on<bf16::Products>(q, H, T, D, k, v, n_kv, head_stride, start, rule, out,
                                       min_units, parallel_for);
    if (operands == Operands::kBf16Values)
      return causal_on<bf16::ValueProducts>(q, H, T, D, k, v, n_kv, head_stride, start, rule,
                                            out, min_units, parallel_for);
  }
  if constexpr (int16::kAvailable) {
    if (operands == Operands::kInt16)
      return int16::causal(q, H, T, D, k, v, n_kv, head_stride, start, rule, out, min_units,
                           parallel_for);
  }
  causal_on<Fp32>(q, H, T, D, k, v, n_kv, head_stride, start, rule, out, min_units,
                  parallel_for);
}

}  // namespace flash
