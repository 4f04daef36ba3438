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
// Included by flash_prefill.h after its tile helpers (vf, KB, ST, NV, RG, QB, fold).
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

// Values [S, D] -> [ceil(S / KB)][KB / 2][D][2].
inline void pair_values(const float* v, int64_t S, int64_t D, uint16_t* out) {
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

// flash_prefill.h's unit, on bf16 products: qs [QB][D] bf16 (rows past `rows` zero), kt and
// vt one kv head's paired keys and values.
template <int DV>
void unit(const uint16_t* qs, int64_t rows, int64_t pos0, const uint16_t* kt, const uint16_t* vt,
          float* out) {
  constexpr int64_t D = 16 * DV;
  Rows<D> s;
  auto& acc = s.acc;
  auto& p = s.p;
  float *m = s.m, *l = s.l, *alpha = s.alpha;
  alignas(64) uint16_t pb[QB + 4][KB];  // p in bf16: pairs of keys for the value products
  for (auto& row : pb) std::fill(row, row + KB, uint16_t(0));  // (rows past `rows` stay zeros)
  const int64_t end = pos0 + rows;
  const int64_t blocks = (end + KB - 1) / KB;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* kb = kt + b * D * KB;
    const uint16_t* vb = vt + b * D * KB;
    const int64_t k0 = b * KB;
    for (int64_t t0 = 0; t0 < rows; t0 += ST) {
      vf sc[ST][NV];
#pragma GCC unroll 8
      for (int i = 0; i < ST; ++i)
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) sc[i][c] = vf{};
      for (int64_t d2 = 0; d2 < D / 2; ++d2) {
        __m512bh kd[NV];
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) kd[c] = load_pairs(kb + (d2 * KB + 16 * c) * 2);
#pragma GCC unroll 8
        for (int i = 0; i < ST; ++i) {
          const __m512bh qd = broadcast_pair(qs + (t0 + i) * D + 2 * d2);
#pragma GCC unroll 8
          for (int c = 0; c < NV; ++c) sc[i][c] = _mm512_dpbf16_ps(sc[i][c], kd[c], qd);
        }
      }
      fold(sc, t0, rows, pos0, k0, p, m, l, alpha);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < NV; c += 2)
        _mm512_storeu_si512(pb[r] + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(
                                                _mm512_loadu_ps(p[r] + 16 * c + 16),
                                                _mm512_loadu_ps(p[r] + 16 * c)));
    // acc = alpha acc + p V, a pair of keys per product (a pair past the block's last key has
    // p = 0 there and zero values)
    constexpr int G = RG * 4 / DV > 0 ? RG * 4 / DV : 1;
    const int64_t pairs = (std::min(KB, end - k0) + 1) / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += G) {
      vf a[G][DV];
      for (int i = 0; i < G; ++i)
        for (int c = 0; c < DV; ++c)
          a[i][c] = r0 + i < rows ? load(acc[r0 + i] + 16 * c) * alpha[r0 + i] : vf{};
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
      for (int i = 0; i < G && r0 + i < rows; ++i)
        for (int c = 0; c < DV; ++c) store(acc[r0 + i] + 16 * c, a[i][c]);
    }
  }
  s.write(rows, out);
}

inline void run_unit(int64_t D, const uint16_t* qs, int64_t rows, int64_t pos0,
                     const uint16_t* kt, const uint16_t* vt, float* out) {
  switch (D) {
    case 64: unit<4>(qs, rows, pos0, kt, vt, out); break;
    case 80: unit<5>(qs, rows, pos0, kt, vt, out); break;
    case 96: unit<6>(qs, rows, pos0, kt, vt, out); break;
    default: unit<8>(qs, rows, pos0, kt, vt, out); break;
  }
}
#else
// (never called: causal() takes this path only where kAvailable)
inline void run_unit(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,
                     const uint16_t*, float*) {
  std::abort();
}
#endif

}  // namespace bf16
}  // namespace flash
