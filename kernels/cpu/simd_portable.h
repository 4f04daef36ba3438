// The SIMD layer (simd.h) in plain C++, for builds without AVX2 or NEON: the same types and
// orders as the vector files, lane by lane (the compiler may vectorize the lanes; each lane's
// operations stay those written here). F8's fma is a * b + c, which the compiler fuses where
// the target has a fused multiply-add (-ffast-math), as it does the scalar code around it.
#pragma once
#include <cstdint>

#include "simd_common.h"
#include <cstring>

namespace simd {

// F8 in lanes of an array: the kernels' vector paths compile here, but the few-row linear keeps
// its own scalar loop on portable builds (kVectorF8 false: linear.h), whose bits differ.
constexpr bool kVectorF8 = false;
constexpr int kF8Registers = 16;  // (unused: linear.h's portable loop)
struct F8 {
  float v[8];
};
inline F8 zero8() { return {{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}}; }
inline F8 set8(float x) { return {{x, x, x, x, x, x, x, x}}; }
inline F8 load8(const float* p) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = p[j];
  return r;
}
inline F8 load8(const int8_t* p) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = float(p[j]);
  return r;
}
inline F8 load8_bf16(const uint16_t* p) {  // bf16 is the top half of an fp32
  F8 r;
  for (int j = 0; j < 8; ++j) {
    const uint32_t bits = uint32_t(p[j]) << 16;
    std::memcpy(&r.v[j], &bits, 4);
  }
  return r;
}
inline float half_to_float(uint16_t h) {  // IEEE binary16 -> fp32, exactly
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, exact in fp32
    float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline F8 load8_fp16(const uint16_t* p) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = half_to_float(p[j]);
  return r;
}
inline void store8(float* p, F8 v) {
  for (int j = 0; j < 8; ++j) p[j] = v.v[j];
}
inline F8 fma(F8 a, F8 b, F8 c) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = c.v[j] + a.v[j] * b.v[j];
  return r;
}
inline float hsum(F8 x) {  // the vector files' order
  const float* l = x.v;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// One float lane: the integer dots' accumulators (DotLanes, simd_common.h: Acc, zero, set1,
// sum).
struct OneLane {
  using V = float;
  static V set(float v) { return v; }
  static float sum(V v) { return v; }
};

// Per chunk an exact int dot, then a float multiply-add in chunk order; one lane.
struct Dot64Portable : DotLanes<OneLane> {
  using W = const int8_t*;
  using X = const int8_t*;
  static W load_w(const int8_t* p) { return p; }
  static X load_x(const int8_t* codes, const int32_t*) { return codes; }
  static Acc fma_dot(W w, X x, Acc step, Acc acc) {
    int32_t dot = 0;
    for (int i = 0; i < 64; ++i) dot += int32_t(w[i]) * int32_t(x[i]);
    return acc + float(dot) * step;
  }
  template <int M>
  static constexpr int nr() { return 1; }
};
using Dot64 = Dot64Portable;

// The W4A8 draft's dot (int4_dot.h) per chunk: an exact int dot of the 32 packed bytes' nibbles
// (low: even inputs, high: odd) with the codes, then acc + dot * scale * step in chunk order;
// one lane.
struct Int4Portable : DotLanes<OneLane> {
  static constexpr int kChunks = 1;
  using S = float;
  using Step = float;
  using W = const uint8_t*;
  struct X {
    const int8_t *even, *odd;
  };
  static W load_w(const uint8_t* p, bool) { return p; }
  static S scales(const float* s, int64_t g0, int64_t) { return s[g0]; }
  static X load_x(const int8_t* even, const int8_t* odd, bool) { return {even, odd}; }
  static Step load_step(const float* step, const float*) { return *step; }
  static Acc fma_dot(W w, const X& x, Step step, S s, Acc acc) {
    int dot = 0;
    for (int i = 0; i < 32; ++i) {
      const uint8_t byte = w[i];
      dot += (byte & 15) * x.even[i];
      dot += (byte >> 4) * x.odd[i];
    }
    return acc + float(dot) * s * step;
  }
  template <int M>
  static constexpr int nr() { return 1; }
};
using Int4 = Int4Portable;

// No vector pass for the activations' rounding, no vector attention (simd_common.h).
using Codes = CodesScalar;
using Attn = AttnScalar;

}  // namespace simd
