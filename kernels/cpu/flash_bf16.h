// The prefill attention's unit on bf16 dot products (AVX512-BF16: Zen 4 and 5, Xeon from
// Cooper Lake): `vdpbf16ps` adds two bf16 products to each fp32 lane, so the scores and the
// value sums take half the multiply-add instructions of flash_prefill.h's fp32 unit, on the
// same pipes. The softmax, the masking and the accumulators stay fp32; what is rounded to bf16
// (8 bits of mantissa, round to nearest even) is every operand of the two products: the
// queries (pre-scaled), keys, values and probabilities. That is the precision of the products
// of a bf16 GEMM; the keys and values of a long prompt's history are already the INT8 view's
// (kernels/planes.py) when they get here.
//
// Layouts, made once per call and kv head (bf16 as uint16_t):
//   keys   [blocks][D / 2][KB][2]   key j of a block, dims 2i and 2i + 1, at [i][j]
//   values [blocks][KB / 2][D][2]   keys 2i and 2i + 1 of a block, dim d, at [i][d]
// so that one 64-byte load is 16 keys x 2 dims (scores) or 16 dims x 2 keys (values), and the
// other operand, 2 query dims or 2 probabilities, is one broadcast 32-bit pair.
//
// Included by flash_prefill.h after its tile helpers (vf, KB, ST, NV, QB) and its unit, which
// runs on these products (Products: the unit's P, as flash_prefill.h's Fp32).
#pragma once

namespace flash {
namespace bf16 {

#if defined(__AVX512BF16__) && defined(QSPEC_AVX512_VNNI)
constexpr bool kAvailable = true;
#else
constexpr bool kAvailable = false;
#endif

// x to bf16, rounded to nearest even, a NaN kept a (quiet) NaN: what vcvtne2ps2bf16 does.
inline uint16_t round(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// Rows [S, D] of keys or values -> a block layout, bf16 (zeros past S): `at(j, d)` is where
// key j of a block, dim d, goes in the block's D KB entries.
template <class At>
inline void pair_rows(const float* x, int64_t S, int64_t D, uint16_t* out, const At& at) {
  const int64_t blocks = (S + KB - 1) / KB;
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* o = out + b * D * KB;
    for (int64_t j = 0; j < KB; ++j) {
      const int64_t key = b * KB + j;
      for (int64_t d = 0; d < D; ++d) o[at(j, d)] = key < S ? round(x[key * D + d]) : 0;
    }
  }
}

// Keys [S, D] -> [ceil(S / KB)][D / 2][KB][2].
inline void pair_keys(const float* k, int64_t S, int64_t D, uint16_t* out) {
  pair_rows(k, S, D, out, [](int64_t j, int64_t d) { return ((d / 2) * KB + j) * 2 + d % 2; });
}

// Values [S, D] -> [ceil(S / KB)][KB / 2][D][2]. (With AVX512-BF16, 16 dims of two keys a
// step: `round` an element at a time was 7% of a 16k-key call. `vcvtneps2bf16` flushes
// subnormal inputs to zero, which `round` does not: values below 1e-38 are zeros here.)
inline void pair_values(const float* v, int64_t S, int64_t D, uint16_t* out) {
#if defined(__AVX512BF16__) && defined(QSPEC_AVX512_VNNI)
  if (D % 16 == 0) {
    const int64_t pairs = (S + KB - 1) / KB * (KB / 2);  // key pairs, the last block's padded
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t j = 2 * i;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 a = j < S ? _mm512_loadu_ps(v + j * D + d) : _mm512_setzero_ps();
        const __m512 b = j + 1 < S ? _mm512_loadu_ps(v + (j + 1) * D + d) : _mm512_setzero_ps();
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
        _mm512_storeu_si512(out + (i * D + d) * 2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    return;
  }
#endif
  pair_rows(v, S, D, out, [D](int64_t j, int64_t d) { return ((j / 2) * D + d) * 2 + j % 2; });
}

#if defined(__AVX512BF16__) && defined(QSPEC_AVX512_VNNI)
inline __m512bh load_pairs(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}
inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// flash_prefill.h's unit's products in bf16 (its P): the queries qs [QB][D] bf16, kt and vt
// one kv head's paired keys and values, and the block's probabilities rounded to bf16 pairs.
struct Products {
  using E = uint16_t;
  using V = uint16_t;
  alignas(64) uint16_t pb[QB + 4][KB];  // p in bf16: pairs of keys for the value products
  struct Context {};

  explicit Products(const Context&) {
    for (auto& row : pb) std::fill(row, row + KB, uint16_t(0));  // (rows past `rows` stay zeros)
  }
  void head(int64_t) {}
  void finish(float*, int64_t, int64_t) const {}
  // A score tile's sc[i] += q_i . keys of the block kb, two dims a product: q the tile's rows.
  template <int64_t D>
  static void scores(const uint16_t* q, int64_t, const uint16_t* kb, vf (&sc)[ST][NV]) {
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      __m512bh kd[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) kd[c] = load_pairs(kb + (d2 * KB + 16 * c) * 2);
#pragma GCC unroll 8
      for (int i = 0; i < ST; ++i) {
        const __m512bh qd = broadcast_pair(q + i * D + 2 * d2);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) sc[i][c] = _mm512_dpbf16_ps(sc[i][c], kd[c], qd);
      }
    }
  }
  // The block's probabilities p [rows][KB] -> pb.
  void probabilities(const float (*p)[KB], int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < NV; c += 2)
        _mm512_storeu_si512(pb[r] + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(
                                                _mm512_loadu_ps(p[r] + 16 * c + 16),
                                                _mm512_loadu_ps(p[r] + 16 * c)));
  }
  // A value group's a[i] += p_{r0 + i} V over the block's nk keys, a pair of keys a product
  // (a pair past the block's last key has p = 0 there and zero values); vb: the block's values.
  template <int64_t D, int G>
  void values(vf (&a)[G][D / 16], int64_t r0, int64_t nk, const uint16_t* vb,
              const float (*)[KB]) const {
    constexpr int DV = D / 16;
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      __m512bh vv[DV];
#pragma GCC unroll 8
      for (int c = 0; c < DV; ++c) vv[c] = load_pairs(vb + (j2 * D + 16 * c) * 2);
#pragma GCC unroll 8
      for (int i = 0; i < G; ++i) {
        const __m512bh pij = broadcast_pair(pb[r0 + i] + 2 * j2);
#pragma GCC unroll 8
        for (int c = 0; c < DV; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], vv[c], pij);
      }
    }
  }
};

// fp32 scores (Fp32's: queries and keys as they are), bf16 value sums (Products'): only the
// probabilities and the values are rounded (a relative 2^-9 each at most), and the value
// sums take half the multiply-adds. Over 512 positions of a 7.5k prefill it moved the
// next-token law a tenth as much as all-bf16 products, less than the INT8 history does
// (docs/PERF.md): a candidate of the measured choice (qspec_core/cache/products_choice.py).
struct ValueProducts : Products {
  using E = float;
  using Products::Products;
  template <int64_t D>
  static void scores(const float* q, int64_t t0, const float* kb, vf (&sc)[ST][NV]) {
    Fp32::scores<D>(q, t0, kb, sc);
  }
};
#else
struct Products;  // (none: causal() takes the bf16 paths only where kAvailable)
struct ValueProducts;
#endif

}  // namespace bf16
}  // namespace flash
