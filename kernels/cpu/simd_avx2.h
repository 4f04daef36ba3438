// The SIMD layer (simd.h) on x86-64 with AVX2, FMA and F16C; AVX-VNNI's 256-bit vpdpbusd
// where the build has it (QSPEC_AVX_VNNI). Also the 8-lane half of the AVX-512 file.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace simd {

constexpr bool kVectorF8 = true;  // F8 is a register (linear.h takes its vector path)
using F8 = __m256;
inline F8 zero8() { return _mm256_setzero_ps(); }
inline F8 set8(float v) { return _mm256_set1_ps(v); }
inline F8 load8(const float* p) { return _mm256_loadu_ps(p); }
inline F8 load8(const int8_t* p) {
  int64_t bits;
  std::memcpy(&bits, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}
inline F8 load8_bf16(const uint16_t* p) {  // bf16 is the top half of an fp32
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline F8 load8_fp16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* p, F8 v) { _mm256_storeu_ps(p, v); }
inline F8 fma(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
inline float hsum(F8 v) {  // ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 64 int8 weights . 64 int8 codes in 8 int32 lanes, then as floats. Without VNNI: |w| (u8)
// times x with w's sign (s8) in pairs (vpmaddubsw, exact: |pair| <= 2 * 128 * 127 < 2^15),
// pairs to quads (vpmaddwd), the chunk's two halves added. With AVX-VNNI: vpdpbusd on w + 128
// (the top bit flipped), each lane starting at -128 times the sum of its eight codes (its
// four in either half, from the caller's offsets): the same integers.
struct Dot64Avx2 {
  using Acc = __m256;
  struct W {
    __m256i lo, hi;
  };
  struct X {
    __m256i lo, hi;
#ifdef QSPEC_AVX_VNNI
    __m256i start;
#endif
  };
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc set1(float v) { return _mm256_set1_ps(v); }
  static W load_w(const int8_t* p) {
    W w{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
#ifdef QSPEC_AVX_VNNI
    const __m256i flip = _mm256_set1_epi8(char(0x80));
    w.lo = _mm256_xor_si256(w.lo, flip), w.hi = _mm256_xor_si256(w.hi, flip);  // w + 128
#endif
    return w;
  }
  // codes [64]; offset [16]: -128 * (sum of codes 4j .. 4j + 3), read by the VNNI form only
  static X load_x(const int8_t* codes, [[maybe_unused]] const int32_t* offset) {
    X x;
    x.lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    x.hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32));
#ifdef QSPEC_AVX_VNNI
    x.start = _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset)),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + 8)));
#endif
    return x;
  }
  // acc + float(w . x lanes) * step
  static Acc fma_dot(const W& w, const X& x, Acc step, Acc acc) {
#ifdef QSPEC_AVX_VNNI
    const __m256i lanes =
        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(x.start, w.lo, x.lo), w.hi, x.hi);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i pl = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(w.lo), _mm256_sign_epi8(x.lo, w.lo)), ones);
    const __m256i ph = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(w.hi), _mm256_sign_epi8(x.hi, w.hi)), ones);
    const __m256i lanes = _mm256_add_epi32(pl, ph);
#endif
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), step, acc);
  }
  static float sum(Acc v) { return hsum(v); }
  template <int M>
  static constexpr int nr() { return M == 1 ? 4 : M <= 3 ? 2 : 1; }  // 16 ymm registers
};

}  // namespace simd
