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

namespace {

// One weight's checks and its part of a product (int_gemm.h `Part`); `keep` holds a bias
// converted to fp32, `out` [M, N] is made here.
intgemm::Part w8a8_part(const at::Tensor& w, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& b, int64_t M, int64_t K,
                        at::Tensor* keep, at::Tensor* out) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8 contiguous w [N, K]");
  const int64_t N = w.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "fp32 scale [N]");
  *out = at::empty({M, N}, at::kFloat);
  return {w.data_ptr<int8_t>(), scale.data_ptr<float>(), bias_of(b, keep, N), N,
          out->data_ptr<float>()};
}

at::Tensor w8a8_input(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32");
  TORCH_CHECK(x.size(0) >= 1, "at least one row");
  TORCH_CHECK(x.size(1) % intdot::CHUNK == 0, "K must be a multiple of 64");
  return x.is_contiguous() ? x : x.contiguous();
}

}  // namespace

at::Tensor w8a8_rows_cpu(at::Tensor x, at::Tensor w, at::Tensor scale,
                            c10::optional<at::Tensor> b) {
  x = w8a8_input(x);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor keep, out;
  const intgemm::Part part = w8a8_part(w, scale, b, M, K, &keep, &out);
  // (a step's few rows: one pass over the weights per 8 rows; a prefill's many: int_gemm.h)
  if (M <= kMaxStepRows)
    intdot::w8a8_rows(x.data_ptr<float>(), M, K, part.w, part.scale, part.bias, part.N,
                      part.out, TorchParallelFor{});
  else
    intgemm::w8a8_prefill(x.data_ptr<float>(), M, K, &part, 1, TorchParallelFor{});
  return out;
}

std::vector<at::Tensor> w8a8_prefill_cpu(at::Tensor x, std::vector<at::Tensor> ws,
                                         std::vector<at::Tensor> scales,
                                         std::vector<c10::optional<at::Tensor>> biases) {
  x = w8a8_input(x);
  const int64_t M = x.size(0), K = x.size(1), P = int64_t(ws.size());
  TORCH_CHECK(M > kMaxStepRows, "a prefill's rows (more than a step's)");
  TORCH_CHECK(P >= 1 && int64_t(scales.size()) == P && int64_t(biases.size()) == P,
              "one scale and one bias (or None) per weight");
  std::vector<at::Tensor> keep(P), outs(P);
  std::vector<intgemm::Part> parts;
  for (int64_t p = 0; p < P; ++p)
    parts.push_back(w8a8_part(ws[p], scales[p], biases[p], M, K, &keep[p], &outs[p]));
  intgemm::w8a8_prefill(x.data_ptr<float>(), M, K, parts.data(), P, TorchParallelFor{});
  return outs;
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
