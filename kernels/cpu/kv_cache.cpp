// The caches' C++ objects (kv_cache.h): the one writer of a step's K/V into a cache's buffers,
// and the attention over them, for the per-layer path and DecoderStack alike.
#include <ATen/ATen.h>

#include <cmath>

#include "kernels.h"  // (the declarations these definitions must match)

namespace {

// The same shape on both, 4 dims: a step's k/v [B, n_kv, T, D] (copy_ would broadcast)
void check_kv(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "k/v must be [B, n_kv, T, D] alike");
}

}  // namespace

HierKV::HierKV(at::Tensor k_upper, at::Tensor k_lower, at::Tensor k_scale, at::Tensor k_zero,
               at::Tensor v_upper, at::Tensor v_lower, at::Tensor v_scale, at::Tensor v_zero,
               at::Tensor fp_k, at::Tensor fp_v, int64_t group_size, int64_t chunk,
               std::vector<int64_t> windows, std::vector<at::Tensor> local,
               std::vector<int64_t> slots)
    : all_{k_upper, k_lower, k_scale, k_zero, v_upper, v_lower, v_scale, v_zero, fp_k, fp_v},
      group_size_(group_size),
      chunk_(chunk),
      windows_(std::move(windows)),
      slots_(std::move(slots)) {
  TORCH_CHECK(fp_k.scalar_type() == at::kFloat && fp_v.scalar_type() == at::kFloat,
              "fp32 full-precision region only");
  TORCH_CHECK(fp_k.dim() == 5 && k_upper.dim() == 5, "buffers of all layers, [L, B, n_kv, ...]");
  TORCH_CHECK(group_size > 0 && chunk > 0, "group size and chunk must be positive");
  const int64_t L = fp_k.size(0);
  TORCH_CHECK(windows_.empty() || int64_t(windows_.size()) == L,
              "one window per layer (0: none), or none at all");
  for (const int64_t w : windows_) TORCH_CHECK(w >= 0, "a sliding window is positive (0: none)");
  TORCH_CHECK(local.empty() || local.size() == 8, "local: the 8 plane tensors, or none");
  if (!local.empty()) {
    local_ = HierLayer{local[0], local[1], local[2], local[3],
                       local[4], local[5], local[6], local[7], {}, {}};
    TORCH_CHECK(local_.k_upper.dim() == 5, "local planes [Ll, B, n_kv, ...]");
  }
  TORCH_CHECK(slots_.empty() || int64_t(slots_.size()) == L, "one slot per layer, or none");
  for (int64_t l = 0; l < int64_t(slots_.size()); ++l) {
    const bool is_local = !windows_.empty() && windows_[l] && !local.empty();
    const int64_t n = is_local ? local_.k_upper.size(0) : k_upper.size(0);
    TORCH_CHECK(slots_[l] >= 0 && slots_[l] < n, "layer ", l, "'s slot is outside its stack");
  }
}

void HierKV::write(int64_t layer, const at::Tensor& k, const at::Tensor& v, int64_t lo) const {
  check_kv(k, v);
  const int64_t T = k.size(2);
  all_.fp_k.select(0, layer).narrow(2, lo, T).copy_(k);
  all_.fp_v.select(0, layer).narrow(2, lo, T).copy_(v);
}

HierAttention HierKV::attention(int64_t layer, const at::Tensor& q,
                                const HierStep& step) const {
  const int64_t window = windows_.empty() ? 0 : windows_.at(layer);
  const bool is_local = window && local_.k_upper.defined();
  const HierLayer& a = is_local ? local_ : all_;
  const int64_t slot = slots_.empty() ? layer : slots_.at(layer);
  const HierLayer one{a.k_upper.select(0, slot),
                      a.k_lower.select(0, slot),
                      a.k_scale.select(0, slot),
                      a.k_zero.select(0, slot),
                      a.v_upper.select(0, slot),
                      a.v_lower.select(0, slot),
                      a.v_scale.select(0, slot),
                      a.v_zero.select(0, slot),
                      all_.fp_k.select(0, layer).narrow(2, 0, step.n_fp),
                      all_.fp_v.select(0, layer).narrow(2, 0, step.n_fp)};
  const int64_t base = is_local ? step.local_base : 0;
  return HierAttention(q, one, step, group_size_, chunk_, window, base);
}

at::Tensor HierKV::attend(int64_t layer, const at::Tensor& q, const HierStep& step) const {
  return run_on_pool(attention(layer, q, step));
}

FullKV::FullKV(at::Tensor k, at::Tensor v, std::vector<int64_t> windows, double softcap,
               at::Tensor local_k, at::Tensor local_v, std::vector<int64_t> slots)
    : k_(k),
      v_(v),
      local_k_(local_k),
      local_v_(local_v),
      windows_(std::move(windows)),
      slots_(std::move(slots)),
      softcap_(softcap) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "fp32 cache only");
  TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes(), "k/v [L, B, n_kv, S, D] alike");
  const int64_t L = slots_.empty() ? k.size(0) : int64_t(slots_.size());
  TORCH_CHECK(windows_.empty() || int64_t(windows_.size()) == L,
              "one window per layer (0: none), or none at all");
  for (const int64_t w : windows_) TORCH_CHECK(w >= 0, "a sliding window is positive (0: none)");
  TORCH_CHECK(softcap >= 0, "a soft cap is positive (0: none)");
  TORCH_CHECK(local_k.defined() == local_v.defined(), "local k and v, or neither");
  if (local_k.defined()) {
    TORCH_CHECK(local_k.scalar_type() == at::kFloat && local_k.dim() == 5 &&
                    local_k.sizes() == local_v.sizes() && local_v.scalar_type() == at::kFloat,
                "local k/v [Ll, B, n_kv, Sw, D] fp32 alike");
    TORCH_CHECK(!windows_.empty() && int64_t(slots_.size()) == L,
                "a local stack needs each layer's window and slot");
  }
  for (int64_t l = 0; l < int64_t(slots_.size()); ++l) {
    const int64_t n = is_local(l) ? local_k.size(0) : k.size(0);
    TORCH_CHECK(slots_[l] >= 0 && slots_[l] < n, "layer ", l, "'s slot is outside its stack");
  }
}

std::pair<at::Tensor, at::Tensor> FullKV::stack(int64_t layer) const {
  const int64_t slot = slots_.empty() ? layer : slots_.at(layer);
  if (is_local(layer)) return {local_k_.select(0, slot), local_v_.select(0, slot)};
  return {k_.select(0, slot), v_.select(0, slot)};
}

namespace {
// `kernels.reference._softcapped_attention` with `_attend`, op for op (the same bits): the
// scaled scores of q [B, H, T, D] over k/v [B, n_kv, S, D] capped, the keys each query sees
// (`visible` [T, S]) softmaxed in fp32, a query that sees none zeros.
at::Tensor softcapped(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& visible, double cap) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), n_kv = k.size(1);
  const auto qg = q.view({B, n_kv, H / n_kv, T, D});
  auto scores = at::einsum("bhrtd,bhsd->bhrts", {qg, k}) * std::pow(double(D), -0.5);
  scores = at::tanh(scores / cap) * cap;
  auto probs = scores.masked_fill(visible.logical_not(), -INFINITY).softmax(-1);
  probs = at::where(visible.any(-1, true), probs, at::zeros({}, probs.options()));
  return at::einsum("bhrts,bhsd->bhrtd", {probs, v}).reshape(q.sizes());
}
}  // namespace

void FullKV::write(int64_t layer, const at::Tensor& k, const at::Tensor& v, int64_t start,
                   int64_t local_base) const {
  check_kv(k, v);
  const int64_t T = k.size(2), first = is_local(layer) ? start - local_base : start;
  const auto [keys, values] = stack(layer);
  TORCH_CHECK(first >= 0 && first + T <= keys.size(2), "a write outside the layer's positions");
  keys.narrow(2, first, T).copy_(k);
  values.narrow(2, first, T).copy_(v);
}

at::Tensor FullKV::attend(int64_t layer, const at::Tensor& q, const FullStep& step) const {
  // a local layer, once its window hides a key, reads [local_start, end) under its own mask
  const bool local = step.local_start >= 0 && !windows_.empty() && windows_.at(layer);
  const int64_t lo = local ? step.local_start : 0;
  TORCH_CHECK(lo <= step.end, "a local layer's keys begin before the step's end");
  // (a local stack's slot 0 holds position local_base: the keys before it were dropped)
  const int64_t base = is_local(layer) ? step.local_base : 0;
  TORCH_CHECK(lo >= base, "a step reads keys a local layer has dropped");
  const auto [keys, values] = stack(layer);
  const auto k = keys.narrow(2, lo - base, step.end - lo);
  const auto v = values.narrow(2, lo - base, step.end - lo);
  const auto& mask = local ? step.local_mask : step.mask;
  const bool is_causal = !local && step.is_causal;
  if (softcap_ > 0) {  // (the keys a query sees, from the mask SDPA would take)
    const int64_t T = q.size(2), S = k.size(2);
    at::Tensor visible;
    if (mask.has_value())
      visible = mask->eq(0);
    else if (is_causal)
      visible = at::ones({T, S}, q.options().dtype(at::kBool)).tril();
    else
      visible = at::ones({T, S}, q.options().dtype(at::kBool));
    return softcapped(q, k, v, visible, softcap_);
  }
  const bool gqa = q.size(1) != k.size(1);
  // the call `kernels.reference.causal_attention` makes
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, c10::nullopt, gqa);
}
