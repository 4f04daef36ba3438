// The torch entry point of the tiled causal attention of a prefill chunk (flash_prefill.h).
#include <ATen/ATen.h>

#include "kernels.h"  // (the declaration this definition must match)
#include "flash_prefill.h"
#include <ATen/Parallel.h>

namespace {
struct TorchParallelFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    at::parallel_for(begin, end, grain, fn);
  }
};
}  // namespace

// q [B, H, T, D] at positions start .. start + T - 1 over k/v [B, n_kv, S, D] (S >= start + T;
// rows of a head contiguous: the cache's buffers, sliced), fp32 -> [B, H, T, D]. products:
// "fp32", or "bf16" (every product) or "bf16-values" (the value sums) on flash_bf16.h's
// products, which builds without AVX512-BF16 lack (PREFILL_BF16 false: refused), or "int16"
// on flash_int16.h's, which need AVX2 (PREFILL_INT16). window: a local layer's sliding window
// (query at p sees keys p - window + 1 .. p; 0: none); softcap: Gemma 2's cap of the scaled
// scores (s -> softcap tanh(s / softcap); 0: none).
at::Tensor prefill_attention_cpu(at::Tensor q, at::Tensor k, at::Tensor v, int64_t start,
                                 const std::string& products, int64_t window,
                                 double softcap) {
  flash::Operands operands = flash::Operands::kFp32;
  if (products == "bf16")
    operands = flash::Operands::kBf16;
  else if (products == "bf16-values")
    operands = flash::Operands::kBf16Values;
  else if (products == "int16")
    operands = flash::Operands::kInt16;
  else
    TORCH_CHECK(products == "fp32", "products: 'fp32', 'bf16', 'bf16-values' or 'int16', not ",
                products);
  TORCH_CHECK(operands == flash::Operands::kFp32 || operands == flash::Operands::kInt16 ||
                  flash::bf16::kAvailable, "bf16 products need a build with AVX512-BF16");
  TORCH_CHECK(operands != flash::Operands::kInt16 || flash::int16::kAvailable,
              "int16 products need an x86 build with AVX2");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v [B, heads, len, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "fp32 q, k, v");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), n_kv = k.size(1);
  TORCH_CHECK(flash::supported(D), "head dim 64, 80, 96, 128 or 256");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && n_kv > 0 &&
                  H % n_kv == 0, "k, v [B, n_kv, S, D] with n_kv dividing H");
  TORCH_CHECK(start >= 0 && k.size(2) >= start + T, "keys for every position up to start + T");
  TORCH_CHECK(window >= 0, "a sliding window is positive (0: none)");
  TORCH_CHECK(softcap >= 0, "a soft cap is positive (0: none)");
  const flash::ScoreRule rule{window, float(softcap)};
  TORCH_CHECK(k.strides() == v.strides() && k.stride(3) == 1 && k.stride(2) == D,
              "k and v alike, rows contiguous per head");
  q = q.contiguous();
  auto out = at::empty({B, H, T, D}, q.options());
  const int64_t min_units = 4 * at::get_num_threads();  // (about 4 units a thread: even shares)
  for (int64_t b = 0; b < B; ++b)
    flash::causal(q.data_ptr<float>() + b * H * T * D, H, T, D,
                  k.data_ptr<float>() + b * k.stride(0), v.data_ptr<float>() + b * v.stride(0),
                  n_kv, k.stride(1), start, rule, out.data_ptr<float>() + b * H * T * D,
                  operands, min_units, TorchParallelFor{});
  return out;
}
