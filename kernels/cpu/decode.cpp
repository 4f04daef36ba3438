// The small ops around a decode step's matmuls, one call each instead of five to ten PyTorch
// ops (a 135M-parameter model runs ~2,000 ops per token; their dispatch cost rivals the
// arithmetic at decode batch sizes). Each has an eager twin in qspec_core/model/ or
// qspec_core/quant/ that the tests compare it against.
//
//   rms_norm_cpu(x, w, eps)          y = w * (x * rsqrt(mean(x^2) + eps)), rows of x [.., H]
//   add_rms_norm_cpu(x, h, w, eps)   x += h in place, then rms_norm(x)
//   rope_cpu(x, cos, sin)            rotate-half RoPE in place on x [B, T, n, D] (stride 1
//                                    along D), cos/sin [T, r]: each head's first r <= D
//                                    channels (r < D: a partial rotary; the rest pass)
#include <ATen/ATen.h>

#include "kernels.h"  // (the declarations these definitions must match)
#include "norm_rope.h"
#include <ATen/Parallel.h>

#include <cmath>

namespace {

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              " must be contiguous fp32");
}

}  // namespace

at::Tensor rms_norm_cpu(at::Tensor x, at::Tensor w, double eps) {
  check_float_rows(x, "x");
  check_float_rows(w, "w");
  const int64_t H = x.size(-1), M = x.numel() / H;
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  norm_rows(xp, wp, yp, M, H, float(eps));
  return y;
}

at::Tensor add_rms_norm_cpu(at::Tensor x, at::Tensor h, at::Tensor w, double eps) {
  check_float_rows(x, "x");
  check_float_rows(w, "w");
  h = h.is_contiguous() ? h : h.contiguous();
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.numel() == x.numel(), "h must match x");
  const int64_t H = x.size(-1), M = x.numel() / H;
  float* xp = x.data_ptr<float>();
  const float *hp = h.data_ptr<float>(), *wp = w.data_ptr<float>();
  auto y = at::empty_like(x);
  float* yp = y.data_ptr<float>();
  add_norm_rows(xp, hp, wp, yp, M, H, float(eps));
  return y;
}

void rope_cpu(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.stride(3) == 1,
              "x must be fp32 [B, T, n, D] with stride 1 along D");
  check_float_rows(cos, "cos");
  check_float_rows(sin, "sin");
  const int64_t B = x.size(0), T = x.size(1), n = x.size(2), r = cos.size(-1);
  TORCH_CHECK(cos.numel() == T * r && sin.sizes() == cos.sizes() &&
                  r <= x.size(3) && r % 2 == 0,
              "cos/sin must be [T, r], r even and at most the head's size");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < n; ++h) {
        float* row = xp + b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
        rope_row(row, cp + t * r, sp + t * r, r);
      }
}
