// The torch entry points of the integer-dot linears (W8A8, W4A8); the cores and their
// description are in int_dot.h and int4_dot.h.
#include <ATen/ATen.h>

#include "kernels.h"  // (the declarations these definitions must match)
#include "int4_dot.h"
#include "int_dot.h"
#include "int_gemm.h"
#include <ATen/Parallel.h>

namespace {

// torch's thread pool for the cores' row blocks.
struct TorchParallelFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    at::parallel_for(begin, end, grain, fn);
  }
};

const float* bias_of(const c10::optional<at::Tensor>& b, at::Tensor* keep, int64_t N) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->numel() == N, "bias [N]");
  *keep = b->to(at::kFloat).contiguous();
  return keep->data_ptr<float>();
}

}  // namespace

at::Tensor w8a8_rows_cpu(at::Tensor x, at::Tensor w, at::Tensor scale,
                            c10::optional<at::Tensor> b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8 contiguous w [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1, "at least one row");
  TORCH_CHECK(K % intdot::CHUNK == 0, "K must be a multiple of 64");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "fp32 scale [N]");
  x = x.is_contiguous() ? x : x.contiguous();
  at::Tensor keep;
  const float* bias = bias_of(b, &keep, N);
  auto out = at::empty({M, N}, at::kFloat);
  // (a step's few rows: one pass over the weights per 8 rows; a prefill's many: int_gemm.h)
  const auto run = M <= kMaxStepRows ? intdot::w8a8_rows<TorchParallelFor>
                                     : intgemm::w8a8_prefill<TorchParallelFor>;
  run(x.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), scale.data_ptr<float>(), bias, N,
      out.data_ptr<float>(), TorchParallelFor{});
  return out;
}

at::Tensor int4_rows_cpu(at::Tensor x, at::Tensor packed, at::Tensor scale,
                            at::Tensor zero, int64_t group_size,
                            c10::optional<at::Tensor> b) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "at most 8 rows");
  constexpr int64_t CHUNK = intdot::CHUNK;
  TORCH_CHECK(group_size > 0 && K % CHUNK == 0 && group_size % CHUNK == 0 && K % group_size == 0,
              "K and the group size must be multiples of 64");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) * 2 == K,
              "packed [N, K/2]");
  TORCH_CHECK(scale.numel() == N * (K / group_size) && zero.numel() == N * (K / group_size),
              "scale and zero [N, K/G]");
  x = x.is_contiguous() ? x : x.contiguous();
  packed = packed.is_contiguous() ? packed : packed.contiguous();
  scale = scale.to(at::kFloat).contiguous();
  zero = zero.to(at::kFloat).contiguous();
  at::Tensor keep;
  const float* bias = bias_of(b, &keep, N);
  auto out = at::empty({M, N}, at::kFloat);
  intdot::int4_rows(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(),
                    scale.data_ptr<float>(), zero.data_ptr<float>(), group_size, bias, N,
                    out.data_ptr<float>(), TorchParallelFor{});
  return out;
}
