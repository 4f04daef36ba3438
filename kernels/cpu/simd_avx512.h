// The SIMD layer (simd.h) on x86-64 with AVX-512 F/BW/DQ/VL and VNNI: the AVX2 file's 8-lane
// F8 (the kernels that sum in eight lanes keep their bits on every x86 build), and the int8
// dot in 16 lanes with vpdpbusd.
#pragma once
#include <immintrin.h>

#include "simd_avx2.h"

namespace simd {

// 64 int8 weights . 64 int8 codes in 16 int32 lanes (vpdpbusd: u8 x s8, four products per
// lane), then as floats. The weights are made unsigned by flipping the top bit (w + 128) and
// each lane starts at -128 times the sum of its four codes (the caller's offsets), so the lane
// is exactly sum w x. Sum: _mm512_reduce_add_ps's fixed order.
struct Dot64Avx512 {
  using Acc = __m512;
  struct W {
    __m512i u;
  };
  struct X {
    __m512i codes, start;
  };
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc set1(float v) { return _mm512_set1_ps(v); }
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
  static float sum(Acc v) { return _mm512_reduce_add_ps(v); }
  template <int M>
  static constexpr int nr() { return M == 1 ? 8 : M <= 4 ? 4 : 2; }  // NR * M accumulators <= 20
};
using Dot64 = Dot64Avx512;

}  // namespace simd
