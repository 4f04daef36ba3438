// The SIMD layer (simd.h) on x86-64 with AVX-512 F/BW/DQ/VL and VNNI: the AVX2 file's 8-lane
// F8 (the kernels that sum in eight lanes keep their bits on every x86 build), and the int8
// dot in 16 lanes with vpdpbusd.
#pragma once
#include <immintrin.h>

#include "simd_avx2.h"

namespace simd {

typedef float f32x16 __attribute__((vector_size(64)));  // (f32x8's and the rest's 512-bit kin)
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef long long i64x8 __attribute__((vector_size(64)));

// Sixteen fp32 lanes (LanesX86 and Lanes8's operations in zmm registers; sum in
// _mm512_reduce_add_ps's order): the integer dots' accumulators and the attention's fold.
struct Lanes16 : LanesX86<Lanes16, f32x16, i32x16> {
  static V set(float v) { return _mm512_set1_ps(v); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V floor(V a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static float max_of(V v) { return _mm512_reduce_max_ps(v); }
};

// 64 int8 weights . 64 int8 codes in 16 int32 lanes (vpdpbusd: u8 x s8, four products per
// lane), then as floats. The weights are made unsigned by flipping the top bit (w + 128) and
// each lane starts at -128 times the sum of its four codes (the caller's offsets), so the lane
// is exactly sum w x. Acc: Lanes16 (sum: _mm512_reduce_add_ps's fixed order).
struct Dot64Avx512 : DotLanes<Lanes16> {
  struct W {
    __m512i u;
  };
  struct X {
    __m512i codes, start;
  };
  static W load_w(const int8_t* p) {
    return {_mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(char(0x80)))};
  }
  static X load_x(const int8_t* codes, const int32_t* offset) {
    return {_mm512_loadu_si512(codes), _mm512_loadu_si512(offset)};
  }
  static Acc fma_dot(const W& w, const X& x, Acc step, Acc acc) {
    const __m512i d = _mm512_dpbusd_epi32(x.start, w.u, x.codes);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), step, acc);
  }
  template <int M>
  static constexpr int nr() { return M == 1 ? 8 : M <= 5 ? 4 : 2; }  // NR * M accumulators <= 20
};
using Dot64 = Dot64Avx512;

// Int4Avx2 with two chunks per 64-byte load: lanes 0-7 hold chunk c's partial dots, lanes 8-15
// chunk c + 1's (the low nibbles against the even codes, the high against the odd, both in one
// int32 lane sum, vpdpbusd); an odd last chunk (`two` false) loads half, its upper lanes zero
// with a zero step (step8's padding). Sum: Lanes16's, _mm512_reduce_add_ps's order.
struct Int4Avx512 : Int4Lanes<Lanes16, i64x8> {
  static constexpr int kChunks = 2;
  static __mmask64 bytes(bool two) { return two ? ~__mmask64(0) : __mmask64(0xFFFFFFFFull); }
  static W load_w(const uint8_t* p, bool two) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i b = _mm512_maskz_loadu_epi8(bytes(two), p);
    return {_mm512_and_si512(b, mask), _mm512_and_si512(_mm512_srli_epi16(b, 4), mask)};
  }
  static S scales(const float* s, int64_t g0, int64_t g1) {
    return _mm512_insertf32x8(_mm512_set1_ps(s[g0]), _mm256_set1_ps(s[g1]), 1);
  }
  static X load_x(const int8_t* even, const int8_t* odd, bool two) {
    return {_mm512_maskz_loadu_epi8(bytes(two), even), _mm512_maskz_loadu_epi8(bytes(two), odd)};
  }
  static Step load_step(const float*, const float* step8) { return _mm512_loadu_ps(step8); }
  static Acc fma_dot(const W& w, const X& x, Step step, S s, Acc acc) {
    const __m512i d =
        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.lo, x.lo), w.hi, x.hi);
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), step), s, acc);
  }
  template <int M>
  static constexpr int nr() { return M <= 2 ? 4 : 2; }  // lo, hi, scales, sums: 4 NR + NR M zmm
};
using Int4 = Int4Avx512;

// The activations' rounding (isa.h's round_to_codes), 16 at a time over x's first multiple of
// 16 (returned): max is exact, so the vector pass gives the scalar one's amax; cvtps rounds half
// to even (the default mode), as the scalar tail's lrintf does.
struct CodesAvx512 {
  static int64_t abs_max(const float* x, int64_t n, float& amax, bool& nan) {
    int64_t i = 0;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 vnan = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    amax = _mm512_reduce_max_ps(vmax), nan = vnan != 0;
    return i;
  }
  template <typename Code>
  static int64_t round(const float* x, int64_t n, float inv, Code* codes) {
    int64_t i = 0;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
      if constexpr (sizeof(Code) == 1)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtsepi32_epi8(c));
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm512_cvtsepi32_epi16(c));
    }
    return i;
  }
};
using Codes = CodesAvx512;

// ----------------------------------------------------------- the attention (attention_*.h)

// AttnAvx2 with the fold, the fixed dot and the integer dots in 16 lanes (the scores keep
// eight keys at a time): AttnX86's ops on these pieces.
struct AttnAvx512 : AttnX86<AttnAvx512> {
  using Fold = Lanes16;  // half the instructions for the same keys (n <= 32)
  // A row's 64 dims are 4 vectors, 4 FMA chains: too few for the FMA latency; 6 rows are 24
  // accumulators + 4 values + a weight in the 32 zmm registers (attention_math.h fold_values)
  static constexpr int kFoldRows = 6;

  // 32 bytes 0..255 -> 32 floats.
  static void bytes_to_floats(__m256i x, float* out) {
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(x))));
    _mm512_storeu_ps(out + 16,
                     _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(x, 1))));
  }

  // Eight vectors of [token 2i: 8 partial sums | token 2i + 1: 8] -> the 16 tokens' sums, in
  // order.
  static __m512i reduce_pairs(const __m512i* v) {
    __m512i a[4], b[2];
    for (int k = 0; k < 4; ++k)  // per 128-bit lane: (x0 + x2, y0 + y2, x1 + x3, y1 + y3)
      a[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                              _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; ++k)  // per lane: the lane's sums of v[4k] .. v[4k + 3]
      b[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
                              _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
    // lanes 0 + 1 and 2 + 3: tokens 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15
    const __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88),
                                       _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    return _mm512_permutexvar_epi32(order, c);
  }
  // 16 tokens at a time with vpdpwssd (rows past `left` hold zeros).
  static constexpr int64_t kDotTokens = 16;
  using Words = __m512i;  // 32 int16
  template <int64_t DT>
  static void row_dots(const int16_t* w, const Words* qv, int32_t* out, int64_t left) {
    constexpr int64_t NV = DT / 32;
    __m512i pairs[8];
    for (int64_t t = 0; t < 16; t += 2) {
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
      for (int64_t v = 0; v < NV; ++v) {
        a = _mm512_dpwssd_epi32(a, _mm512_loadu_si512(w + t * DT + 32 * v), qv[v]);
        b = _mm512_dpwssd_epi32(b, _mm512_loadu_si512(w + (t + 1) * DT + 32 * v), qv[v]);
      }  // two tokens' 16 partials -> [8 | 8]
      pairs[t / 2] = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44),
                                      _mm512_shuffle_i32x4(a, b, 0xEE));
    }
    _mm512_mask_storeu_epi32(out, __mmask16((1u << left) - 1), reduce_pairs(pairs));
  }
};
using Attn = AttnAvx512;

}  // namespace simd
