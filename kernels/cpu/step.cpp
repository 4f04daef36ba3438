// A decode-sized forward (at most kMaxStepRows = 17 tokens) through every decoder layer in one C++ call.
//
// A 135M-parameter model makes about 25 PyTorch calls per layer in a decode step; from Python
// each costs 3-15 us on this class of CPU, which adds up to as much as the arithmetic of the
// step (a draft step at short context spent half its time between kernels). `DecoderStack`
// holds one path's weights (fp32, or the draft's 4-bit twins) and runs the same kernels in
// the same order as `CpuBackend._layers` (qspec_core/backend/cpu.py), so the two give the
// same bits (`tests/test_cpu_step.py`); the embedding, the final norm and the LM head stay in
// Python.
//
// Shapes: x [B, T, hidden] fp32 contiguous, updated in place (the residual stream); cos/sin
// [T, D]. Per layer: q/k/v [B, T, n, D] from the projections, RoPE in place, then attention
// through the cache's C++ object (kv_cache.h: `HierKV` or `FullKV`), which writes the layer's
// new K/V into the cache's buffers and attends over them with the step the cache filled
// (`HierStep`: the hierarchical planes and full-precision region; `FullStep`: SDPA over
// [0, end) with the cache's mask or is_causal).
#include <torch/extension.h>  // (the stack is a pybind11 class)

#include <functional>
#include <vector>

#include "kernels.h"

namespace {

// One linear layer, x [M, K] -> [M, N]: fp32 weight [N, K]; or the W4A8 draft twin (packed
// [N, K/2], scale/zero [N, K/G]); or the INT8 target twin (int8 [N, K], fp32 scale [N]), run
// as `Int8Linear` runs a step's rows: `int8_rows_cpu` (W8A32) or, with int8 activations
// (`a8`), `w8a8_rows_cpu`.
struct Projection {
  at::Tensor weight, packed, scale, zero, int8;
  c10::optional<at::Tensor> bias;
  int64_t group_size = 0;
  bool a8 = false;

  at::Tensor operator()(const at::Tensor& x) const {
    if (packed.defined()) return int4_rows_cpu(x, packed, scale, zero, group_size, bias);
    if (int8.defined() && a8) return w8a8_rows_cpu(x, int8, scale, bias);
    if (int8.defined()) return int8_rows_cpu(x, int8, scale, bias);
    return linear_rows_cpu(x, weight, bias);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection q, k, v, o, gate, up, down;
};

// (layer, q [B, H, T, D], k/v [B, n_kv, T, D]) -> attention output [B, H, T, D]
using Attend = std::function<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&)>;

}  // namespace

class DecoderStack {
 public:
  DecoderStack(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps)
      : H_(n_heads), n_kv_(n_kv_heads), D_(head_dim), eps_(eps) {}

  // The next projection of the layer being built, in the order q, k, v, o, gate, up, down.
  void add_linear(at::Tensor weight, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(),
                "fp32 contiguous weights only");
    Projection p;
    p.weight = weight, p.bias = bias;
    pending_.push_back(p);
  }

  void add_int4_linear(at::Tensor packed, at::Tensor scale, at::Tensor zero,
                       int64_t group_size, c10::optional<at::Tensor> bias) {
    Projection p;
    p.packed = packed, p.scale = scale, p.zero = zero, p.group_size = group_size, p.bias = bias;
    pending_.push_back(p);
  }

  // int8_activations: round x to int8 per 64 inputs (W8A8) instead of keeping it fp32 (W8A32)
  void add_int8_linear(at::Tensor weight_int8, at::Tensor weight_scale,
                       c10::optional<at::Tensor> bias, bool int8_activations) {
    TORCH_CHECK(weight_scale.scalar_type() == at::kFloat, "fp32 INT8 scales only");
    Projection p;
    p.int8 = weight_int8, p.scale = weight_scale, p.bias = bias, p.a8 = int8_activations;
    pending_.push_back(p);
  }

  // Closes a layer: its two norms and the seven projections added since the last one.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm) {
    TORCH_CHECK(pending_.size() == 7, "a layer takes 7 projections, got ", pending_.size());
    layers_.push_back(Layer{input_norm, post_norm, pending_[0], pending_[1], pending_[2],
                            pending_[3], pending_[4], pending_[5], pending_[6]});
    pending_.clear();
  }

  int64_t size() const { return int64_t(layers_.size()); }

  // One forward through every layer over a cache's C++ object (kv_cache.h), which writes each
  // layer's new K/V into the cache and attends over it, with the step the cache filled.
  at::Tensor run_hier(at::Tensor x, at::Tensor cos, at::Tensor sin, const HierKV& cache,
                      const HierStep& step) {
    return run_cached(x, cos, sin, cache, step, step.lo);
  }

  at::Tensor run_full(at::Tensor x, at::Tensor cos, at::Tensor sin, const FullKV& cache,
                      const FullStep& step) {
    return run_cached(x, cos, sin, cache, step, step.start);
  }

 private:
  // run over `cache`, each layer's new K/V written from token `first` of its region (the
  // hierarchical cache's full-precision region, the full cache's rows)
  template <class Cache, class Step>
  at::Tensor run_cached(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const Cache& cache, const Step& step, int64_t first) {
    return run(x, cos, sin, [&](int64_t l, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v) {
      cache.write(l, k, v, first);
      return cache.attend(l, q, step);
    });
  }

  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                    const Attend& attend) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3,
                "x must be contiguous fp32 [B, T, hidden]");
    TORCH_CHECK(x.size(0) * x.size(1) <= kMaxStepRows, "a decode step: at most ", kMaxStepRows,
                " tokens");
    TORCH_CHECK(pending_.empty(), "a layer is half built");
    const int64_t B = x.size(0), T = x.size(1), M = B * T;
    auto rows = x.view({M, x.size(2)});  // the residual stream, updated in place
    for (int64_t l = 0; l < size(); ++l) {
      const Layer& L = layers_[l];
      auto h = rms_norm_cpu(rows, L.input_norm, eps_);
      auto q = L.q(h).view({B, T, H_, D_});
      auto k = L.k(h).view({B, T, n_kv_, D_});
      auto v = L.v(h).view({B, T, n_kv_, D_});
      rope_cpu(q, cos, sin);  // in place, on the projections' fresh outputs
      rope_cpu(k, cos, sin);
      auto out = attend(l, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2));
      h = L.o(out.transpose(1, 2).reshape({M, H_ * D_}));
      auto y = add_rms_norm_cpu(rows, h, L.post_norm, eps_);  // rows += h
      auto up = L.up(y);
      rows.add_(L.down(at::silu(L.gate(y)).mul_(up)));
    }
    return x;
  }

  int64_t H_, n_kv_, D_;
  double eps_;
  std::vector<Layer> layers_;
  std::vector<Projection> pending_;
};

void bind_decoder_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack",
                                 "one path's decoder layers, run in one call per forward")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add_linear", &DecoderStack::add_linear)
      .def("add_int4_linear", &DecoderStack::add_int4_linear)
      .def("add_int8_linear", &DecoderStack::add_int8_linear)
      .def("add_layer", &DecoderStack::add_layer)
      .def("__len__", &DecoderStack::size)
      // (the forward touches no Python object: other threads may run meanwhile)
      // run(x, cos, sin, cache, step): a `HierKV` with its `HierStep`, or a `FullKV` with
      // its `FullStep` (the cache's `native` and `native_step`)
      .def("run", &DecoderStack::run_hier, pybind11::arg("x"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("cache"), pybind11::arg("step"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run", &DecoderStack::run_full, pybind11::arg("x"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("cache"), pybind11::arg("step"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
