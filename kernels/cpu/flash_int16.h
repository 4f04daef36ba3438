// The prefill attention's unit on int16 dot products: with AVX512-VNNI (Zen 4 and 5, Xeon from
// Cascade Lake) `vpdpwssd` adds two int16 products to each int32 lane, 32 multiply-adds an
// instruction, twice the fp32 FMA's, on the same pipes; on AVX2 `vpmaddwd` then `vpaddd`, 16
// per two instructions, where an FMA does 8 (with AVX-VNNI, `vpdpwssd` on ymm: both in one;
// flash_int16_avx2.h). What is rounded, each to half a step:
//   values         per channel over the call's rows: step max_t |v_td| / 8191
//   keys           the same, step max_t |k_td| / 8191 for D <= 64, / 4095 to 128, / 2047 above
//   queries        per row, after the keys' steps are folded in: step max_d |q'_d| / 4095
//   probabilities  per row and block of keys: step 2^(e - 11), 2^e <= the block's largest p
//                  (a power of two: no division in the block loop; codes 0..4096)
// so an operand is off by at most 2^-13 to 2^-14 of the largest of its row, channel or block,
// where bf16 (flash_bf16.h) is off by 2^-9 of itself. On the inputs of a real prefill (every
// SmolLM2 layer's 512-row chunk after 7,168 tokens) the output was off by 1.3e-3 of its norm
// against exact attention, bf16's by 6.6e-3 (docs/PERF.md). The int32 sums are exact: a
// score's D terms, 64 * 4095 * 8191, 128 * 4095 * 4095 and 256 * 4095 * 2047 < 2^31, and a
// block's value sums over KB <= 64 keys, 64 * 4096 * 8191 < 2^31. Each score and each block's
// value sums go to fp32 with their steps (the values' channel steps once, at the end); the
// softmax, the masking and the accumulators are flash_prefill.h's, fp32. The twin:
// `kernels.cpu.attention.prefill_attention_int16_ref`. A row's rounding depends on every key
// of its call (the channels' steps): unlike the fp32 products, the same position can round
// differently in another chunking.
//
// Layouts, made once per call and kv head (int16 pairs, one 32-bit word each):
//   keys   [blocks][D / 2][KB][2]   key j of a block, dims 2i and 2i + 1, at [i][j]
//   values [blocks][KB / 2][D][2]   keys 2i and 2i + 1 of a block, dim d, at [i][d]
//   queries [QB][D]                 a row's codes in order (dims 2i, 2i + 1: word i)
// so that one vector load is L keys x 2 dims (scores) or L dims x 2 keys (values), and the
// other operand, 2 query dims or 2 probabilities, is one broadcast word. KB is flash_prefill.h's:
// 64 keys with AVX-512, 32 on 8-lane builds (the probabilities' steps are per block, so the
// twin folds `PREFILL_KEY_BLOCK` keys at a time). The roundings and layouts are written once
// on flash_int16_lanes.h's vectors; the products per instruction set.
//
// Included by flash_prefill.h after its tile helpers, its unit and flash_bf16.h.
#pragma once

namespace flash {
namespace int16 {

#if defined(QSPEC_AVX512_VNNI) || defined(QSPEC_AVX2)
constexpr bool kAvailable = true;

constexpr float kValueLevels = 8191.f, kQueryLevels = 4095.f;
inline float key_levels(int64_t D) { return D <= 64 ? 8191.f : D <= 128 ? 4095.f : 2047.f; }
constexpr int64_t kMaxHeadDim = 256;  // (flash::supported's widest: the row buffers below)
constexpr int kProbBits = 11, kProbMax = 4096;  // p codes in [2^11, 2^12] for a block's largest

// The step of amax over `levels` codes and its inverse (0 and 0 where amax < kMinAmax: all
// codes 0). A NaN or an infinity among the rounded values (amax NaN or infinite) gives codes
// 0 and a step of NaN or infinity, so the NaN reaches every output the step scales, as with
// the fp32 products (not a finite-looking code: a NaN converts to INT_MIN). (volatile:
// -ffast-math would make amax / levels amax * (1 / levels), an ulp off the twin's division.)
inline void step_of(float amax, float levels, float& step, float& inv) {
  volatile float l = levels;
  if (std::isnan(amax) || std::isinf(amax)) {
    step = std::numeric_limits<float>::quiet_NaN();
    inv = 0.f;
    return;
  }
  if (!(amax >= kMinAmax)) {
    step = inv = 0.f;
    return;
  }
  step = amax / l;
  inv = l / amax;
}

#include "flash_int16_lanes.h"

// The channels' steps of rows x [S, D] (D a multiple of L, at most kMaxHeadDim) over `levels`
// codes each side of 0, and their inverses.
inline void channel_steps(const float* x, int64_t S, int64_t D, float levels, float* step,
                          float* inv) {
  constexpr int N = Lanes::N;
  Lanes::AbsMax m[kMaxHeadDim / N];
  for (int64_t t = 0; t < S; ++t)
    for (int64_t c = 0; c < D / N; ++c) m[c].add(Lanes::load(x + t * D + N * c));
  for (int64_t c = 0; c < D / N; ++c) {
    float amax[N];
    m[c].get(amax);
    for (int j = 0; j < N; ++j) step_of(amax[j], levels, step[N * c + j], inv[N * c + j]);
  }
}

// Keys [S, D] -> [ceil(S / KB)][D / 2][KB] words (zeros past S): a block's rows rounded to
// codes in order (a row's words are its dim pairs), then its words transposed.
inline void pair_keys(const float* k, int64_t S, int64_t D, const float* inv, int16_t* out) {
  constexpr int N = Lanes::N;
  const int64_t blocks = (S + KB - 1) / KB, half = D / 2;
  const int levels = int(key_levels(D));
  std::vector<uint32_t> rows(KB * half);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t j = 0; j < KB; ++j) {
      const int64_t key = b * KB + j;
      auto* row = reinterpret_cast<int16_t*>(rows.data() + j * half);
      for (int64_t d = 0; d < D; d += N)
        Lanes::store_codes(row + d, key < S ? Lanes::codes(Lanes::load(k + key * D + d),
                                                           Lanes::load(inv + d), levels)
                                            : Lanes::zero());
    }
    int16_t* o = out + b * D * KB;  // (words copied as bytes: out is int16 storage)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < KB; ++j) std::memcpy(o + 2 * (i * KB + j), &rows[j * half + i], 4);
  }
}

// Values [S, D] -> [ceil(S / KB)][KB / 2][D] words (zeros past S): L dims of two keys a step.
inline void pair_values(const float* v, int64_t S, int64_t D, const float* inv, int16_t* out) {
  constexpr int N = Lanes::N;
  const int64_t pairs = (S + KB - 1) / KB * (KB / 2);  // key pairs, the last block's padded
  const int levels = int(kValueLevels);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t j = 2 * i;
    for (int64_t d = 0; d < D; d += N) {
      const Lanes::F vi = Lanes::load(inv + d);
      const Lanes::I a = j < S ? Lanes::codes(Lanes::load(v + j * D + d), vi, levels)
                               : Lanes::zero();
      const Lanes::I b = j + 1 < S ? Lanes::codes(Lanes::load(v + (j + 1) * D + d), vi, levels)
                                   : Lanes::zero();
      Lanes::store_words(out + (i * D + d) * 2, a, b);
    }
  }
}

// A query row q [D] -> codes [D]: q' = q * scale * key_step (per dim), rounded per row;
// returns the row's step (0 for a row of zeros).
inline float round_query(const float* q, float scale, const float* key_step, int64_t D,
                         int16_t* out) {
  constexpr int N = Lanes::N;
  Lanes::F x[kMaxHeadDim / N];
  Lanes::AbsMax m;
  for (int64_t c = 0; c < D / N; ++c) {
    x[c] = Lanes::mul(Lanes::mul(Lanes::load(q + N * c), Lanes::set1(scale)),
                      Lanes::load(key_step + N * c));
    m.add(x[c]);
  }
  float step, inv;
  step_of(m.top(), kQueryLevels, step, inv);
  for (int64_t c = 0; c < D / N; ++c)
    Lanes::store_codes(out + N * c, Lanes::codes(x[c], Lanes::set1(inv), int(kQueryLevels)));
  return step;
}

// What flash_prefill.h's unit needs of the int16 products (its P) beside the dot products,
// which each instruction set's Products adds: the element types, the context (the steps of
// the unit's query rows, head h's at query_step + h QB, 0 past `rows`, and of the kv head's
// value channels), the block's probability codes and the finish.
struct ProductsBase {
  using E = int16_t;
  using V = int16_t;
  struct Context {
    const float* query_step;  // [heads][QB]
    const float* value_step;  // [D]
  };
  const Context ctx;
  const float* row_step = nullptr;  // the current head's rows' steps
  alignas(64) int16_t pb[QB + 4][KB];  // a block's probability codes: pairs of keys
  float p_step[QB + 4];  // each row's probability step in the block

  explicit ProductsBase(const Context& c) : ctx(c) {
    for (auto& row : pb) std::fill(row, row + KB, int16_t(0));  // (rows past `rows`: zeros)
    std::fill(p_step, p_step + QB + 4, 0.f);
  }
  void head(int64_t h) { row_step = ctx.query_step + h * QB; }

  // The block's probabilities p [rows][KB] (in [0, 1], masked keys 0; a positive p is at
  // least exp(-87), a normal float) -> codes in pb, a step a row: 2^(e - 11) for the
  // largest's exponent e, made from its exponent bits (exact, no division). (A NaN p, from
  // a NaN score, makes the step NaN: step_of's rule.)
  void probabilities(const float (*p)[KB], int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      Lanes::AbsMax m;
      for (int c = 0; c < NV; ++c) m.add(Lanes::load(p[r] + L * c));
      uint32_t bits;
      const float top = m.top();
      std::memcpy(&bits, &top, 4);
      const uint32_t e = (bits >> 23) & 0xFF;  // biased exponent (p >= 0)
      float inv = 0.f;
      p_step[r] = 0.f;
      if (e == 0xFF) {
        p_step[r] = std::numeric_limits<float>::quiet_NaN();
      } else if (e > kProbBits) {  // (else all zeros, or too small to matter: codes 0)
        const uint32_t step_bits = (e - kProbBits) << 23, inv_bits = (254 - e + kProbBits) << 23;
        std::memcpy(&p_step[r], &step_bits, 4);
        std::memcpy(&inv, &inv_bits, 4);
      }
      for (int c = 0; c < NV; ++c)
        Lanes::store_codes(pb[r] + L * c,
                           Lanes::codes(Lanes::load(p[r] + L * c), Lanes::set1(inv), kProbMax));
    }
  }
  // A head's output rows out [rows, D] (Rows::write's), in value steps -> in values.
  void finish(float* out, int64_t rows, int64_t D) const {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) out[r * D + d] *= ctx.value_step[d];
  }
};

#if defined(QSPEC_AVX512_VNNI)
inline __m512 as_m512(const vf& v) { return (__m512)v; }

// acc += a . b, two int16 products per int32 lane. GCC 12 compiles the intrinsic in these
// loops with a register copy around most vpdpwssd (perf: the copies took more samples than
// the products); with the accumulator tied in place the loop is the tile's (int_gemm.h's
// dpbusd, the same fix). Same instruction, same bits.
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpwssd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "v"(b));  // (AT&T | Intel)
  return acc;
#else
  return _mm512_dpwssd_epi32(acc, a, b);
#endif
}

// A vector the compiler must hold in a register (flash_prefill.h's in_register): a tile's key
// or value vector serves every row, and GCC 12 otherwise loads it again for each.
inline __m512i held(__m512i v) {
  asm("" : "+v"(v));
  return v;
}

inline __m512i broadcast_word(const int16_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}

// The AVX-512 VNNI dot products: 16 keys (scores) or 16 dims (values) a vector.
struct Products : ProductsBase {
  using ProductsBase::ProductsBase;

  // A score tile's sc[i] = step_i (q_i . keys of the block kb), two dims a product, summed in
  // int32: q the tile's rows, from the head's row t0.
  template <int64_t D>
  void scores(const int16_t* q, int64_t t0, const int16_t* kb, vf (&sc)[ST][NV]) const {
    __m512i s[ST][NV];
#pragma GCC unroll 8
    for (int i = 0; i < ST; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) s[i][c] = _mm512_setzero_si512();
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      __m512i kd[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) kd[c] = held(_mm512_loadu_si512(kb + (d2 * KB + 16 * c) * 2));
#pragma GCC unroll 8
      for (int i = 0; i < ST; ++i) {
        const __m512i qd = broadcast_word(q + i * D + 2 * d2);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) s[i][c] = dpwssd(s[i][c], kd[c], qd);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ST; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c)
        sc[i][c] = (vf)_mm512_mul_ps(_mm512_cvtepi32_ps(s[i][c]), _mm512_set1_ps(row_step[t0 + i]));
  }
  // A value group's a[i] += p_{r0 + i} V over the block's nk keys, a pair of keys a product,
  // summed in int32 and taken to fp32 with the row's probability step, in units of the
  // channels' value steps (`finish` applies them; a pair past the block's last key has p = 0
  // there and zero values); vb: the block's values.
  template <int64_t D, int G>
  void values(vf (&a)[G][D / 16], int64_t r0, int64_t nk, const int16_t* vb,
              const float (*)[KB]) const {
    constexpr int DV = D / 16;
    const int64_t pairs = (nk + 1) / 2;
    __m512i s[G][DV];
#pragma GCC unroll 8
    for (int i = 0; i < G; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < DV; ++c) s[i][c] = _mm512_setzero_si512();
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      __m512i vv[DV];
#pragma GCC unroll 8
      for (int c = 0; c < DV; ++c) vv[c] = held(_mm512_loadu_si512(vb + (j2 * D + 16 * c) * 2));
#pragma GCC unroll 8
      for (int i = 0; i < G; ++i) {
        const __m512i pij = broadcast_word(pb[r0 + i] + 2 * j2);
#pragma GCC unroll 8
        for (int c = 0; c < DV; ++c) s[i][c] = dpwssd(s[i][c], vv[c], pij);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < G; ++i) {
      const __m512 ps = _mm512_set1_ps(p_step[r0 + i]);
#pragma GCC unroll 8
      for (int c = 0; c < DV; ++c)
        a[i][c] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][c]), ps, as_m512(a[i][c]));
    }
  }
};
#else  // AVX2 (and AVX-VNNI)
#include "flash_int16_avx2.h"
#endif

// One batch item, as causal_on (flash_prefill.h) on these products: each kv head's keys and
// values rounded per channel and laid out once per call, each unit's query rows rounded with
// its kv head's key steps.
template <class For>
void causal(const float* q, int64_t H, int64_t T, int64_t D, const float* k, const float* v,
            int64_t n_kv, int64_t head_stride, int64_t start, const ScoreRule& rule, float* out,
            int64_t min_units, const For& parallel_for) {
  const int64_t group = H / n_kv, end = start + T, key_blocks = (end + KB - 1) / KB;
  const int64_t per_head = key_blocks * D * KB;
  std::vector<int16_t> kt(n_kv * per_head), vt(n_kv * per_head);
  std::vector<float> steps(4 * n_kv * D);  // per kv head: key steps, inverses, value's, inverses
  parallel_for(0, n_kv, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      float* s = steps.data() + 4 * g * D;
      channel_steps(k + g * head_stride, end, D, key_levels(D), s, s + D);
      pair_keys(k + g * head_stride, end, D, s + D, kt.data() + g * per_head);
      channel_steps(v + g * head_stride, end, D, kValueLevels, s + 2 * D, s + 3 * D);
      pair_values(v + g * head_stride, end, D, s + 3 * D, vt.data() + g * per_head);
    }
  });
  const float scale = 1.f / std::sqrt(float(D));
  const int64_t q_blocks = (T + QB - 1) / QB;
  const int64_t heads = unit_heads(group, n_kv, q_blocks, min_units), subs = group / heads;
  parallel_for(0, n_kv * subs * q_blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int16_t> qs(heads * QB * D);
    std::vector<float> q_step(heads * QB);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / (subs * q_blocks), h0 = g * group + (u / q_blocks) % subs * heads;
      const int64_t r0 = (u % q_blocks) * QB, rows = std::min(QB, T - r0);
      const float* s = steps.data() + 4 * g * D;
      std::fill(qs.begin(), qs.end(), int16_t(0));
      std::fill(q_step.begin(), q_step.end(), 0.f);
      for (int64_t i = 0; i < heads; ++i)
        for (int64_t r = 0; r < rows; ++r)
          q_step[i * QB + r] = round_query(q + ((h0 + i) * T + r0 + r) * D, scale, s, D,
                                           qs.data() + (i * QB + r) * D);
      const Products::Context ctx{q_step.data(), s + 2 * D};
      run_unit<Products>(D, ctx, qs.data(), rows, heads, start + r0, rule,
                         kt.data() + g * per_head, vt.data() + g * per_head,
                         out + (h0 * T + r0) * D, T * D);
    }
  });
}
#else
constexpr bool kAvailable = false;
struct Products;  // (none: flash::causal takes the int16 path only where kAvailable)
template <class For>
[[noreturn]] void causal(const float*, int64_t, int64_t, int64_t, const float*, const float*,
                         int64_t, int64_t, int64_t, const ScoreRule&, float*, int64_t,
                         const For&) {
  std::abort();  // (never called: flash::causal checks kAvailable first)
}
#endif

}  // namespace int16
}  // namespace flash
