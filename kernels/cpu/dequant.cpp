// The hierarchical cache's planes back to fp32, for a prefill chunk's attention over the
// quantized history (qspec_core/cache/prefill.py). One pass: a token's D/2 bytes per plane plus
// its scales in, D floats out; portable C++ the compiler vectorizes (no intrinsics needed: the
// loop is a byte unpack, an integer add and a multiply-add per element).
//
// Element d of a token (packed byte d / 2: even d in the low nibble, odd d in the high one):
//   code = 16 U + (lower - 8)                       (the INT8 view; U alone for INT4)
//   x    = code * (s / 16) + z                      (s / 1 and U for INT4)
// exactly as `kernels.planes.dequantize_keys` / `dequantize_values` compute it in PyTorch (a
// rounded multiply, then a rounded add: no FMA contraction here, so the bits are the twin's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"  // (the declaration this definition must match)

#if defined(__clang__)
#pragma clang fp contract(off)
#define QSPEC_NO_CONTRACT
#elif defined(__GNUC__)
#define QSPEC_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define QSPEC_NO_CONTRACT
#endif

namespace {

// One token: up/lo [D/2] bytes, scale/zero per element (keys: `s`/`z` [D], a channel's) or
// per group of G elements (values: [D/G]), out [D]. Specialized per case so the loop
// vectorizes.
template <bool kPerChannel, bool kInt8>
QSPEC_NO_CONTRACT void token(const uint8_t* __restrict up, const uint8_t* __restrict lo,
                             const float* __restrict s, const float* __restrict z, int64_t G,
                             int64_t D, float* __restrict out) {
  constexpr float kDivisor = kInt8 ? 16.f : 1.f;
  for (int64_t j = 0; j < D / 2; ++j) {
    const int u0 = up[j] & 15, u1 = up[j] >> 4;
    const int c0 = kInt8 ? 16 * u0 + (lo[j] & 15) - 8 : u0;
    const int c1 = kInt8 ? 16 * u1 + (lo[j] >> 4) - 8 : u1;
    const int64_t g0 = kPerChannel ? 2 * j : 2 * j / G, g1 = kPerChannel ? 2 * j + 1 : 2 * j / G;
    out[2 * j] = float(c0) * (s[g0] / kDivisor) + z[g0];
    out[2 * j + 1] = float(c1) * (s[g1] / kDivisor) + z[g1];
  }
}

using TokenFn = void (*)(const uint8_t*, const uint8_t*, const float*, const float*, int64_t,
                         int64_t, float*);

}  // namespace

// upper/lower [B, n, T, D/2] uint8 (a token's bytes contiguous); keys (`per_channel`): scale/
// zero [B, n, T/G, D]; values: [B, n, T, D/G]; out [B, n, T, D] fp32 (a token's D contiguous),
// written in place. `int8`: both planes, else the upper one.
void dequantize_planes_cpu(at::Tensor upper, at::Tensor lower, at::Tensor scale,
                           at::Tensor zero, int64_t group_size, bool per_channel, bool int8,
                           at::Tensor out) {
  TORCH_CHECK(upper.dim() == 4 && upper.sizes() == lower.sizes() && out.dim() == 4,
              "planes [B, n, T, D/2], out [B, n, T, D]");
  TORCH_CHECK(upper.scalar_type() == at::kByte && lower.scalar_type() == at::kByte &&
                  scale.scalar_type() == at::kFloat && zero.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat, "uint8 planes, fp32 scales and out");
  const int64_t B = upper.size(0), n = upper.size(1), T = upper.size(2), D = 2 * upper.size(3);
  const int64_t G = group_size;
  TORCH_CHECK(G > 0 && D % G == 0 && (!per_channel || T % G == 0), "group size");
  TORCH_CHECK(out.size(0) == B && out.size(1) == n && out.size(2) == T && out.size(3) == D,
              "out [B, n, T, D]");
  TORCH_CHECK(scale.sizes() == zero.sizes() && scale.size(0) == B && scale.size(1) == n &&
                  scale.size(2) == (per_channel ? T / G : T) &&
                  scale.size(3) == (per_channel ? D : D / G), "scales of the grouping");
  for (const at::Tensor* t : {&upper, &lower, &scale, &zero, &out})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == t->size(3), "rows contiguous");
  TORCH_CHECK(upper.strides() == lower.strides() && scale.strides() == zero.strides(),
              "planes alike, scales alike");
  const uint8_t* up = upper.data_ptr<uint8_t>();
  const uint8_t* lo = lower.data_ptr<uint8_t>();
  const float* sc = scale.data_ptr<float>();
  const float* ze = zero.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // (G even: a byte's two elements share a value group)
  TORCH_CHECK(per_channel || G % 2 == 0, "an even group size");
  const TokenFn fn = per_channel ? (int8 ? token<true, true> : token<true, false>)
                                 : (int8 ? token<false, true> : token<false, false>);
  // work items: (batch, head, token); a few thousand tokens per task
  at::parallel_for(0, B * n * T, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (n * T), h = i / T % n, t = i % T;
      const int64_t p = b * upper.stride(0) + h * upper.stride(1) + t * upper.stride(2);
      const int64_t m = b * scale.stride(0) + h * scale.stride(1) +
                        (per_channel ? t / G : t) * scale.stride(2);
      fn(up + p, lo + p, sc + m, ze + m, G, D,
         o + b * out.stride(0) + h * out.stride(1) + t * out.stride(2));
    }
  });
}
