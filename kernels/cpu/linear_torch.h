// torch's 16-bit floats as weights of the few-row linears (linear.h): bf16 and fp16 [N, K]
// widened to fp32 in registers, exactly, so a bf16 weight gives the bits its fp32 upcast gives
// (the same products in the same order). Included by the torch translation units that run
// the core on such weights: linear.cpp (the entry points) and step.cpp (the decode stack, whose
// full-precision weights run from a bf16 copy where they are bf16 numbers: half the bytes).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "linear.h"

namespace rowlinear {
template <>
struct Weight<c10::BFloat16> {
  static float f32(c10::BFloat16 w) { return static_cast<float>(w); }
  static simd::F8 load8(const c10::BFloat16* p) {
    return simd::load8_bf16(reinterpret_cast<const uint16_t*>(p));
  }
};
template <>
struct Weight<c10::Half> {
  static float f32(c10::Half w) { return static_cast<float>(w); }
  static simd::F8 load8(const c10::Half* p) {
    return simd::load8_fp16(reinterpret_cast<const uint16_t*>(p));
  }
};
}  // namespace rowlinear
