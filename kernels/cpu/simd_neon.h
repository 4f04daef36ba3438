// The SIMD layer (simd.h) on aarch64 NEON: the AVX2 file's lanes in pairs of 128-bit
// registers (F8: lanes 0-3, 4-7), the same fused multiply-adds per lane and the same
// horizontal order, so the kernels on this layer give the AVX2 build's bits (kernels/cpu/tests
// checks it under emulation).
#pragma once
#include <arm_neon.h>

#include <cstdint>

#include "simd_common.h"

namespace simd {

constexpr bool kVectorF8 = true;  // F8 is a pair of vector registers
constexpr int kF8Registers = 16;  // (32 q registers, two an F8)
struct F8 {
  float32x4_t lo, hi;
};
inline F8 zero8() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline F8 set8(float v) { return {vdupq_n_f32(v), vdupq_n_f32(v)}; }
inline F8 load8(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline F8 load8(const int8_t* p) {
  const int16x8_t h = vmovl_s8(vld1_s8(p));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_high_s16(h))};
}
inline F8 load8_bf16(const uint16_t* p) {  // bf16 is the top half of an fp32
  const uint16x8_t u = vld1q_u16(p);
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(u), 16)),
          vreinterpretq_f32_u32(vshll_high_n_u16(u, 16))};
}
inline F8 load8_fp16(const uint16_t* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline void store8(float* p, F8 v) { vst1q_f32(p, v.lo), vst1q_f32(p + 4, v.hi); }
inline F8 fma(F8 a, F8 b, F8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
// The AVX2 order ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), in vector operations (that
// -ffast-math leaves in order).
inline float hsum(F8 v) {
  const float32x4_t s = vaddq_f32(v.lo, v.hi);
  const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
  return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

// acc + the products of w and x, four adjacent bytes per int32 lane (lane j: bytes 4j .. 4j + 3),
// exactly: sdot with dotprod; else products (|p| <= 128 * 127), adjacent pairs (< 2^15), then
// pairs of pairs. Both give the same integers.
inline int32x4_t dot16(int32x4_t acc, int8x16_t w, int8x16_t x) {
#ifdef QSPEC_NEON_DOTPROD
  return vdotq_s32(acc, w, x);
#else
  const int16x8_t pairs =
      vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x)), vmull_high_s8(w, x));
  return vpadalq_s16(acc, pairs);
#endif
}

// F8 as the integer dots' float lanes (DotLanes, simd_common.h: Acc, zero, set1, sum).
struct F8Lanes {
  using V = F8;
  static V set(float v) { return set8(v); }
  static float sum(V v) { return hsum(v); }
};

// The AVX2 file's eight int32 lanes of a 64-byte dot as two int32x4 (lanes 0-3: bytes 0-15 and
// 32-47, four per lane; lanes 4-7: bytes 16-31 and 48-63), then the same float operations.
struct Dot64Neon : DotLanes<F8Lanes> {
  struct W {
    int8x16_t v[4];
  };
  using X = W;
  static W load_w(const int8_t* p) {
    return {{vld1q_s8(p), vld1q_s8(p + 16), vld1q_s8(p + 32), vld1q_s8(p + 48)}};
  }
  static X load_x(const int8_t* codes, const int32_t*) { return load_w(codes); }
  static Acc fma_dot(const W& w, const X& x, Acc step, Acc acc) {
    const int32x4_t zero = vdupq_n_s32(0);
    const int32x4_t lo = dot16(dot16(zero, w.v[0], x.v[0]), w.v[2], x.v[2]);
    const int32x4_t hi = dot16(dot16(zero, w.v[1], x.v[1]), w.v[3], x.v[3]);
    return {vfmaq_f32(acc.lo, vcvtq_f32_s32(lo), step.lo),
            vfmaq_f32(acc.hi, vcvtq_f32_s32(hi), step.hi)};
  }
  template <int M>
  static constexpr int nr() { return M == 1 ? 4 : M <= 3 ? 2 : 1; }  // as AVX2 (32 q registers)
};
using Dot64 = Dot64Neon;

// The W4A8 draft's dot (int4_dot.h) as the AVX2 file's: its lanes as two int32x4 (lanes 0-3:
// packed bytes 0-15 of the chunk, 4-7: bytes 16-31; low nibbles against the even codes, high
// against the odd, dot16), the same fp32 operations per lane, the same sum.
struct Int4Neon : DotLanes<F8Lanes> {
  static constexpr int kChunks = 1;
  using S = float32x4_t;
  using Step = float32x4_t;
  struct W {
    int8x16_t lo[2], hi[2];
  };
  using X = W;
  static W load_w(const uint8_t* p, bool) {
    const uint8x16_t mask = vdupq_n_u8(0x0F);
    W w;
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t b = vld1q_u8(p + 16 * h);
      w.lo[h] = vreinterpretq_s8_u8(vandq_u8(b, mask));
      w.hi[h] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
    }
    return w;
  }
  static S scales(const float* s, int64_t g0, int64_t) { return vdupq_n_f32(s[g0]); }
  static X load_x(const int8_t* even, const int8_t* odd, bool) {
    return {{vld1q_s8(even), vld1q_s8(even + 16)}, {vld1q_s8(odd), vld1q_s8(odd + 16)}};
  }
  static Step load_step(const float* step, const float*) { return vdupq_n_f32(*step); }
  static Acc fma_dot(const W& w, const X& x, Step step, S s, Acc acc) {
    const int32x4_t none = vdupq_n_s32(0);
    float32x4_t a[2] = {acc.lo, acc.hi};
    for (int h = 0; h < 2; ++h) {
      const int32x4_t lanes = dot16(dot16(none, w.lo[h], x.lo[h]), w.hi[h], x.hi[h]);
      a[h] = vfmaq_f32(a[h], vmulq_f32(vcvtq_f32_s32(lanes), step), s);
    }
    return {a[0], a[1]};
  }
  template <int M>
  static constexpr int nr() { return M == 1 ? 4 : M == 2 ? 2 : 1; }
};
using Int4 = Int4Neon;

// No vector pass for the activations' rounding, no vector attention (simd_common.h).
using Codes = CodesScalar;
using Attn = AttnScalar;

}  // namespace simd
