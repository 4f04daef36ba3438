// The float side of the CPU attention over the hierarchical cache (hier_attention.cpp): the
// online-softmax fold of a block of scored keys into a row's (acc, max, sum), fp32 scores, and
// the decoders of the nibble planes and of the full-precision rows into the kernel's
// "deinterleaved" order (see hier_attention.cpp). Portable C++, AVX2/FMA and AVX-512; included by
// hier_attention.cpp alone.
#pragma once
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace attn {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Dims per deinterleaved segment: 64, or the whole head when 64 does not divide it.
inline int64_t segment_width(int64_t D) { return D % 64 == 0 ? 64 : D; }

// ------------------------------------------------------------------------------ portable path

// Nibble rows -> codes in deinterleaved order: U (draft) or 16 U + L with L = lower - 8
// (target), as floats. out [n, D].
inline void block_codes(const uint8_t* __restrict up, const uint8_t* __restrict lo, int64_t n,
                        int64_t D, bool target, float* __restrict out) {
  const int64_t W = segment_width(D), hw = W / 2, half = D / 2;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t s = 0; s < D; s += W) {
      const uint8_t* u = up + j * half + s / 2;
      const uint8_t* w = lo + j * half + s / 2;
      float* o = out + j * D + s;
      if (!target) {
        for (int64_t i = 0; i < hw; ++i) o[i] = float(u[i] & 15);
        for (int64_t i = 0; i < hw; ++i) o[hw + i] = float(u[i] >> 4);
      } else {
        for (int64_t i = 0; i < hw; ++i) o[i] = float(16 * (u[i] & 15) + (w[i] & 15) - 8);
        for (int64_t i = 0; i < hw; ++i) o[hw + i] = float(16 * (u[i] >> 4) + (w[i] >> 4) - 8);
      }
    }
  }
}

// Fold scored keys into row r: p [n] holds scores (-inf for hidden keys) and is overwritten;
// values vb [n, D]; `vscale`/`vzero` (per token, or null when vb holds values) turn codes into
// values: sum_j p_j (s_j c_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j (the latter in zacc);
// vscale holds s_j already divided by the view's step divisor.
inline void fold_row_portable(float* __restrict p, int64_t n, const float* __restrict vb,
                              const float* vscale, const float* vzero, int64_t D,
                              float* __restrict acc, float& m, float& l, float& zacc) {
  float mx = m;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == NEG_INF) return;
  const float corr = std::exp(m - mx);  // 0 while m was -inf
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = std::exp(p[j] - mx);
    sum += p[j];
  }
  float z = zacc * corr;
  if (vscale != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      z += p[j] * vzero[j];
      p[j] *= vscale[j];
    }
  }
  zacc = z;
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* __restrict vj = vb + j * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += pj * vj[d];
  }
  l = l * corr + sum;
  m = mx;
}

inline void scores_portable(const float* __restrict qr, const float* __restrict kb, int64_t n,
                            int64_t D, float bias, float* __restrict p) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict kj = kb + j * D;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
    p[j] = dot + bias;
  }
}

// ------------------------------------------------------------------------------ AVX2 path
#ifdef QSPEC_AVX2

// exp(x) for the softmax (x <= 0), Cephes' polynomial: a few ulp; exp(-inf) = 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Eight vectors -> the vector of their eight horizontal sums, in order.
inline __m256 hsum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 32 bytes 0..255 -> 32 floats.
inline void bytes_to_floats(__m256i x, float* out) {
#ifdef QSPEC_AVX512_VNNI
  _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(x))));
  _mm512_storeu_ps(out + 16,
                   _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(x, 1))));
#else
  const __m128i lo = _mm256_castsi256_si128(x), hi = _mm256_extracti128_si256(x, 1);
  _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
  _mm256_store_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
  _mm256_store_ps(out + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
  _mm256_store_ps(out + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
#endif
}

// One 64-dim segment of a token (32 bytes per plane) -> its bytes u in the kernel's order: the
// low nibbles (even dims), then the high ones (odd dims); U (draft) or 16 U + lower (target;
// lower is L + 8, and the caller folds the + 8 into the zeros or the scores' bias).
template <bool TARGET>
inline void segment_bytes(const uint8_t* up, const uint8_t* lo, __m256i& even, __m256i& odd) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(up));
  if (!TARGET) {
    even = _mm256_and_si256(u, m);
    odd = _mm256_and_si256(_mm256_srli_epi16(u, 4), m);
  } else {
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
    even = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, m), 4), _mm256_and_si256(l, m));
    odd = _mm256_or_si256(_mm256_andnot_si256(m, u),
                          _mm256_and_si256(_mm256_srli_epi16(l, 4), m));
  }
}

// The segment's 64 codes as floats (the values' decoder).
template <bool TARGET>
inline void decode_segment(const uint8_t* up, const uint8_t* lo, float* out) {
  __m256i even, odd;
  segment_bytes<TARGET>(up, lo, even, odd);
  bytes_to_floats(even, out);
  bytes_to_floats(odd, out + 32);
}

// 64 fp32 dims in original order -> deinterleaved (even dims, then odd).
inline void deinterleave_segment(const float* in, float* out) {
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_loadu_ps(in + 16 * i), b = _mm256_loadu_ps(in + 16 * i + 8);
    const __m256 ev = _mm256_shuffle_ps(a, b, 0x88), od = _mm256_shuffle_ps(a, b, 0xDD);
    _mm256_store_ps(out + 8 * i,
                    _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
    _mm256_store_ps(out + 32 + 8 * i,
                    _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
  }
}

// Scores of one row against n keys kb [n, D]: p[j] = qr . k_j + bias. Eight keys at a time,
// eight independent FMA chains, one transposed reduction.
template <int64_t D>
inline void scores_avx2(const float* __restrict qr, const float* __restrict kb, int64_t n,
                        float bias, float* __restrict p) {
  constexpr int64_t NV = D / 8;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    const float* k = kb + j * D;
    for (int64_t v = 0; v < NV; ++v) {
      const __m256 qv = _mm256_loadu_ps(qr + 8 * v);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_load_ps(k + t * D + 8 * v), acc[t]);
    }
    _mm256_storeu_ps(p + j, _mm256_add_ps(hsum8(acc), _mm256_set1_ps(bias)));
  }
  for (; j < n; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t v = 0; v < NV; ++v)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * v), _mm256_load_ps(kb + j * D + 8 * v), acc);
    p[j] = hsum(acc) + bias;
  }
}

// fold_row_portable with intrinsics (n <= BLOCK).
template <int64_t D>
inline void fold_row_avx2(float* __restrict p, int64_t n, const float* __restrict vb,
                          const float* vscale, const float* vzero, float* __restrict acc, float& m, float& l, float& zacc) {
  constexpr int64_t NV = D / 8;
  const int64_t n8 = n & ~int64_t(7);  // whole vectors; the tail goes scalar
  __m256 vm = _mm256_set1_ps(m);
  for (int64_t j = 0; j < n8; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(p + j));
  __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
  float mx = std::max(_mm_cvtss_f32(h4), _mm_cvtss_f32(_mm_movehdup_ps(h4)));
  for (int64_t j = n8; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == NEG_INF) return;
  const float corr = std::exp(m - mx);  // 0 while m was -inf
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps(), vz = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmx));
    vsum = _mm256_add_ps(vsum, e);
    if (vscale != nullptr) {  // per-token value scales (already / div) and zeros
      vz = _mm256_fmadd_ps(e, _mm256_loadu_ps(vzero + j), vz);
      e = _mm256_mul_ps(e, _mm256_loadu_ps(vscale + j));
    }
    _mm256_storeu_ps(p + j, e);
  }
  float sum = hsum(vsum), z = zacc * corr + hsum(vz);
  for (int64_t j = n8; j < n; ++j) {
    float e = std::exp(p[j] - mx);
    sum += e;
    if (vscale != nullptr) {
      z += e * vzero[j];
      e *= vscale[j];
    }
    p[j] = e;
  }
  zacc = z;
  int64_t j;
  const __m256 vc = _mm256_set1_ps(corr);
  for (int64_t h = 0; h < NV; h += 8) {  // 64 dims at a time: the accumulators stay in registers
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (h + i)), vc);
    for (j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      const float* vj = vb + j * D + 8 * h;
      for (int i = 0; i < 8; ++i) r[i] = _mm256_fmadd_ps(w, _mm256_load_ps(vj + 8 * i), r[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * (h + i), r[i]);
  }
  l = l * corr + sum;
  m = mx;
}
#endif  // QSPEC_AVX2

#ifdef QSPEC_AVX512_VNNI
// exp256 with 16 lanes (the same polynomial).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)),
                    _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// fold_row_avx2 with 16 lanes: half the instructions for the same keys (n <= 32).
template <int64_t D>
inline void fold_row_avx512(float* __restrict p, int64_t n, const float* __restrict vb,
                            const float* vscale, const float* vzero, float* __restrict acc,
                            float& m, float& l, float& zacc) {
  constexpr int64_t NV = D / 16;
  const int64_t n16 = n & ~int64_t(15);  // whole vectors; the tail goes scalar
  __m512 vm = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n16; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(p + j));
  float mx = _mm512_reduce_max_ps(vm);
  for (int64_t j = n16; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == NEG_INF) return;
  const float corr = std::exp(m - mx);  // 0 while m was -inf
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps(), vz = _mm512_setzero_ps();
  for (int64_t j = 0; j < n16; j += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + j), vmx));
    vsum = _mm512_add_ps(vsum, e);
    if (vscale != nullptr) {  // per-token value scales (already / div) and zeros
      vz = _mm512_fmadd_ps(e, _mm512_loadu_ps(vzero + j), vz);
      e = _mm512_mul_ps(e, _mm512_loadu_ps(vscale + j));
    }
    _mm512_storeu_ps(p + j, e);
  }
  float sum = _mm512_reduce_add_ps(vsum), z = zacc * corr + _mm512_reduce_add_ps(vz);
  for (int64_t j = n16; j < n; ++j) {
    float e = std::exp(p[j] - mx);
    sum += e;
    if (vscale != nullptr) {
      z += e * vzero[j];
      e *= vscale[j];
    }
    p[j] = e;
  }
  zacc = z;
  const __m512 vc = _mm512_set1_ps(corr);
  for (int64_t h = 0; h < NV; h += 4) {  // 64 dims at a time: the accumulators stay in registers
    __m512 r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * (h + i)), vc);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 w = _mm512_set1_ps(p[j]);
      const float* vj = vb + j * D + 16 * h;
      for (int i = 0; i < 4; ++i) r[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 16 * i), r[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + 16 * (h + i), r[i]);
  }
  l = l * corr + sum;
  m = mx;
}
#endif  // QSPEC_AVX512_VNNI

#ifdef QSPEC_AVX2
// The widest fold this build has, for head_dim D (64 or 128).
template <int64_t D>
inline void fold_row_fast(float* __restrict p, int64_t n, const float* __restrict vb,
                          const float* vscale, const float* vzero, float* __restrict acc,
                          float& m, float& l, float& zacc) {
#ifdef QSPEC_AVX512_VNNI
  fold_row_avx512<D>(p, n, vb, vscale, vzero, acc, m, l, zacc);
#else
  fold_row_avx2<D>(p, n, vb, vscale, vzero, acc, m, l, zacc);
#endif
}
#endif  // QSPEC_AVX2

}  // namespace attn

