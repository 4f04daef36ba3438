// The SIMD layer (simd.h) on x86-64 with AVX2, FMA and F16C; AVX-VNNI's 256-bit vpdpbusd
// where the build has it (QSPEC_AVX_VNNI). Also the 8-lane half of the AVX-512 file and what
// the two x86 files share: LanesX86 (fp32 lanes at any width), Int4Lanes (the W4A8 dot's
// registers), AttnX86 (the attention's ops on a file's own lanes and byte conversion).
#pragma once
#include <immintrin.h>

#include "simd_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace simd {

constexpr bool kVectorF8 = true;  // F8 is a register (linear.h takes its vector path)
// F8 registers a kernel may fill with accumulators and operands: 16 ymm, or 32 where AVX-512VL
// adds ymm16-31 (linear.h sizes its blocks by it; the bits do not depend on it)
#if defined(__AVX512VL__)
constexpr int kF8Registers = 32;
#else
constexpr int kF8Registers = 16;
#endif
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

// ------------------------------------------------------------------ fp32 lanes (both x86 files)

// x86 registers as plain vector types: __m256 and __m256i less their may_alias, which GCC drops
// from a template argument, with a warning (simd_avx512.h: the 512-bit ones). What LanesX86 and
// Int4Lanes take.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef long long i64x4 __attribute__((vector_size(32)));

// What an x86 register of fp32 lanes V (f32x8, f32x16) does the same at any width; VI: V's int32
// lanes. add, sub, mul, load and store are plain vector arithmetic and memory copies: what GCC
// and Clang define _mm256_add_ps, _mm512_add_ps, _mm256_loadu_ps ... to be, so the code and the
// bits are the intrinsics'. pow2 likewise (vcvttps2dq, vpaddd, vpslld: _mm256_cvttps_epi32's
// and the rest's instructions) and exp (cephes_exp). Self (Lanes8, Lanes16) adds what names its
// width's instructions: set, min, max, fma (a * b + c), fnma (c - a * b), floor, sum, max_of.
template <class Self, class Vec, class VecI>
struct LanesX86 {
  using V = Vec;
  using VI = VecI;
  static constexpr int kLanes = sizeof(V) / sizeof(float);
  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  // 2^n for integral n (cephes_exp's: -127..128): n + 127 in the exponent field
  static V pow2(V n) { return (V)((__builtin_convertvector(n, VI) + 127) << 23); }
  static V exp(V x) { return cephes_exp<Self>(x); }  // (simd_common.h)
};

// Eight fp32 lanes: the integer dots' accumulators (Dot64Avx2, Int4Avx2) and the attention's
// scores (both x86 files) and fold (AttnAvx2).
struct Lanes8 : LanesX86<Lanes8, f32x8, i32x8> {
  static V set(float v) { return _mm256_set1_ps(v); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V floor(V a) { return _mm256_floor_ps(a); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static float sum(V v) { return hsum(v); }
  static float max_of(V v) {
    __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
    return std::max(_mm_cvtss_f32(h4), _mm_cvtss_f32(_mm_movehdup_ps(h4)));
  }
  // Eight vectors -> the vector of their eight horizontal sums, in order (one transposed
  // reduction; its own order, not hsum's).
  static V sums8(const V* v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};

// 64 int8 weights . 64 int8 codes in 8 int32 lanes, then as floats. Without VNNI: |w| (u8)
// times x with w's sign (s8) in pairs (vpmaddubsw, exact: |pair| <= 2 * 128 * 127 < 2^15),
// pairs to quads (vpmaddwd), the chunk's two halves added. With AVX-VNNI: vpdpbusd on w + 128
// (the top bit flipped), each lane starting at -128 times the sum of its eight codes (its
// four in either half, from the caller's offsets): the same integers. Acc: Lanes8.
struct Dot64Avx2 : DotLanes<Lanes8> {
  struct W {
    __m256i lo, hi;
  };
  struct X {
    __m256i lo, hi;
#ifdef QSPEC_AVX_VNNI
    __m256i start;
#endif
  };
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
  template <int M>
  static constexpr int nr() { return M == 1 ? 4 : M <= 3 ? 2 : 1; }  // 16 ymm registers
};

// The registers of an x86 W4A8 dot (Int4Avx2, Int4Avx512): accumulators, a weight row's group
// scale(s) and the chunk's step(s) in L's float lanes; the packed bytes' low and high nibbles
// (W) and the chunk's even and odd codes (X) in I's bytes (i64x4, i64x8).
template <class L, class I>
struct Int4Lanes : DotLanes<L> {
  using S = typename L::V;
  using Step = typename L::V;
  struct W {
    I lo, hi;
  };
  using X = W;
};

// The W4A8 draft's dot (int4_dot.h): a 64-input chunk is 32 packed bytes (input 2i in the low
// nibble of byte i, 2i + 1 in the high one) against the chunk's even and odd int8 codes. Per
// chunk: acc += (float(lanes) * step) * scale, lanes the exact int32 sums of nibble x code
// (vpmaddubsw: 32 nibbles (u8) times 32 codes, pairs added, exact: |pair| <= 2 * 15 * 127;
// AVX-VNNI: vpdpbusd). One chunk a step; sum: hsum.
struct Int4Avx2 : Int4Lanes<Lanes8, i64x4> {
  static constexpr int kChunks = 1;  // chunks a step takes
  static W load_w(const uint8_t* p, bool) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_and_si256(b, mask), _mm256_and_si256(_mm256_srli_epi16(b, 4), mask)};
  }
  static S scales(const float* s, int64_t g0, int64_t) { return _mm256_set1_ps(s[g0]); }
  static X load_x(const int8_t* even, const int8_t* odd, bool) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd))};
  }
  // step: the chunk's step (step8: it 8 times, then the next chunk's, for 16-lane files)
  static Step load_step(const float* step, const float*) { return _mm256_broadcast_ss(step); }
  static Acc fma_dot(const W& w, const X& x, Step step, S s, Acc acc) {
#ifdef QSPEC_AVX_VNNI
    const __m256i lanes = _mm256_dpbusd_avx_epi32(
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w.lo, x.lo), w.hi, x.hi);
#else
    const __m256i lanes = _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, x.lo), _mm256_maddubs_epi16(w.hi, x.hi)),
        _mm256_set1_epi16(1));
#endif
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lanes), step), s, acc);
  }
  template <int M>
  static constexpr int nr() { return M == 1 ? 4 : M == 2 ? 2 : 1; }
};

// (The activations' rounding has no AVX2 vector pass: CodesScalar, simd_common.h.)

// ----------------------------------------------------------- the attention (attention_*.h)

// The attention's vector ops both x86 files share, on Self's (AttnAvx2, AttnAvx512) own
// pieces: Fold (the softmax fold's lanes, which the fixed dot takes too) and bytes_to_floats.
// A 64-dim segment of a token is 32 bytes per nibble plane (byte b: positions b and 32 + b of
// the kernel's deinterleaved order, attention_math.h).
template <class Self>
struct AttnX86 {
  static constexpr bool kVector = true;
  using Scores = Lanes8;  // the scores' lanes: eight keys at a time, sums8
  // Rows whose values' fold shares one pass (attention_math.h fold_values): 1 where a row's
  // 64 dims already fill eight FMA chains (eight lanes), more in AttnAvx512
  static constexpr int kFoldRows = 1;

  // sum_d a_d b_d over the first dims, a multiple of Fold's lanes (returned), then Fold's sum.
  static int64_t dot_prefix(const float* a, const float* b, int64_t D, float& sum) {
    return dot_prefix_lanes<typename Self::Fold>(a, b, D, sum);
  }

  // The segment's bytes u in the kernel's order: the low nibbles (even dims), then the high
  // ones (odd dims); U (draft) or 16 U + lower (target; lower is L + 8, and the caller folds
  // the + 8 into the zeros or the scores' bias).
  template <bool TARGET>
  static void segment_bytes(const uint8_t* up, const uint8_t* lo, __m256i& even, __m256i& odd) {
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
  // The segment's 64 codes as floats [64] (the values' decoder); out 32-byte aligned.
  template <bool TARGET>
  static void decode_segment(const uint8_t* up, const uint8_t* lo, float* out) {
    __m256i even, odd;
    segment_bytes<TARGET>(up, lo, even, odd);
    Self::bytes_to_floats(even, out);
    Self::bytes_to_floats(odd, out + 32);
  }
  // The segment's bytes u as int16 [64] (the integer scores' keys).
  template <bool TARGET>
  static void segment_words(const uint8_t* up, const uint8_t* lo, int16_t* out) {
    __m256i even, odd;
    segment_bytes<TARGET>(up, lo, even, odd);
    const __m256i bytes[2] = {even, odd};
    for (int h = 0; h < 2; ++h) {
      __m256i* o = reinterpret_cast<__m256i*>(out + 32 * h);
      _mm256_storeu_si256(o, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes[h])));
      _mm256_storeu_si256(o + 1, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes[h], 1)));
    }
  }
  // 64 fp32 dims in original order -> deinterleaved (even dims, then odd); out 32-byte aligned.
  static void deinterleave_segment(const float* in, float* out) {
    for (int i = 0; i < 4; ++i) {
      const __m256 a = _mm256_loadu_ps(in + 16 * i), b = _mm256_loadu_ps(in + 16 * i + 8);
      const __m256 ev = _mm256_shuffle_ps(a, b, 0x88), od = _mm256_shuffle_ps(a, b, 0xDD);
      _mm256_store_ps(out + 8 * i,
                      _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
      _mm256_store_ps(out + 32 + 8 * i,
                      _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
    }
  }
};

// The attention's vector ops in eight lanes (AttnX86's, and the AVX2 halves below).
struct AttnAvx2 : AttnX86<AttnAvx2> {
  using Fold = Lanes8;  // the softmax fold's lanes

  // 32 bytes 0..255 -> 32 floats; out 32-byte aligned.
  static void bytes_to_floats(__m256i x, float* out) {
    const __m128i lo = _mm256_castsi256_si128(x), hi = _mm256_extracti128_si256(x, 1);
    _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    _mm256_store_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    _mm256_store_ps(out + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    _mm256_store_ps(out + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
  }

  // Integer dots of one row's int16 codes (in Words, the row's DT codes) against kDotTokens
  // tokens' words w [kDotTokens, DT]: vpmaddwd per token, one transposed reduction; the first
  // `left` sums go to out.
  static constexpr int64_t kDotTokens = 8;
  using Words = __m256i;  // 16 int16
  template <int64_t DT>
  static void row_dots(const int16_t* w, const Words* qv, int32_t* out, int64_t left) {
    constexpr int64_t NV = DT / 16;
    __m256i acc[8];
    for (int64_t t = 0; t < 8; ++t) {
      acc[t] = _mm256_setzero_si256();
      for (int64_t v = 0; v < NV; ++v)
        acc[t] = _mm256_add_epi32(
            acc[t], _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                          w + t * DT + 16 * v)),
                                      qv[v]));
    }
    const __m256i u0 =
        _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
    const __m256i u1 =
        _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]), _mm256_hadd_epi32(acc[6], acc[7]));
    alignas(32) int32_t tmp[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp),
                       _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                        _mm256_permute2x128_si256(u0, u1, 0x31)));
    std::copy(tmp, tmp + left, out);
  }
};

}  // namespace simd
