// The torch entry points of the few-row linears; the core and its description are in linear.h.
#include <ATen/ATen.h>

#include "kernels.h"  // (the declarations these definitions must match)
#include "linear_torch.h"
#include <ATen/Parallel.h>

#include <cstdint>


namespace {

// torch's thread pool for the core's row blocks.
struct TorchParallelFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    at::parallel_for(begin, end, grain, fn);
  }
};

// Checks shared by both entry points; returns x as contiguous fp32 [M, K] and the bias.
at::Tensor check_rows(const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& b, at::Tensor* bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxStepRows, "1 to ", kMaxStepRows, " rows");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  if (b.has_value() && b->defined()) *bias = b->to(at::kFloat).contiguous();
  return x.is_contiguous() ? x : x.contiguous();
}

}  // namespace

at::Tensor linear_rows_cpu(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> b) {
  at::Tensor bias;
  x = check_rows(x, w, b, &bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const TorchParallelFor par;
  switch (w.scalar_type()) {
    case at::kFloat:
      rowlinear::rows(xp, w.data_ptr<float>(), nullptr, bp, op, M, K, N, par);
      break;
    case at::kBFloat16:
      rowlinear::rows(xp, w.data_ptr<c10::BFloat16>(), nullptr, bp, op, M, K, N, par);
      break;
    case at::kHalf:
      rowlinear::rows(xp, w.data_ptr<c10::Half>(), nullptr, bp, op, M, K, N, par);
      break;
    default: TORCH_CHECK(false, "weights must be fp32, bf16 or fp16");
  }
  return out;
}

at::Tensor int8_rows_cpu(at::Tensor x, at::Tensor w, at::Tensor scale,
                            c10::optional<at::Tensor> b) {
  at::Tensor bias;
  x = check_rows(x, w, b, &bias);
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8 weights [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0) &&
                  scale.is_contiguous(),
              "fp32 scale [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, at::kFloat);
  rowlinear::rows(x.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                  bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K,
                  N, TorchParallelFor{});
  return out;
}
