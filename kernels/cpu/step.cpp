// A decode-sized forward (at most kMaxStepRows tokens) through every decoder layer in one C++ call.
//
// A 135M-parameter model makes about 25 PyTorch calls per layer in a decode step; from Python
// each costs 3-15 us on this class of CPU, which adds up to as much as the arithmetic of the
// step (a draft step at short context spent half its time between kernels). `DecoderStack`
// holds one path's weights (fp32, the INT8 target's or the draft's 4-bit twins) and runs the
// kernels the model's layer loop runs through the CPU runner's ops, so the two give the same
// bits (`tests/test_cpu_step.py`); the embedding, the final norm and the LM head stay in
// Python. Between two attentions, the layers' kernels run on one team of threads (team.h),
// not one thread-pool region each.
//
// Shapes: x [B, T, hidden] fp32 contiguous, updated in place (the residual stream); cos/sin
// [T, D]. Per layer: q/k/v [B, T, n, D] from the projections, RoPE in place, then attention
// through the cache's C++ object (kv_cache.h: `HierKV` or `FullKV`), which writes the layer's
// new K/V into the cache's buffers and attends over them with the step the cache filled
// (`HierStep`: the hierarchical planes and full-precision region; `FullStep`: SDPA over
// [0, end) with the cache's mask or is_causal).
#include <torch/extension.h>  // (the stack is a pybind11 class)

#include <array>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "int4_dot.h"
#include "int_dot.h"
#include "kernels.h"
#include "linear_torch.h"
#include "norm_rope.h"
#include "team.h"

namespace {

// One linear layer, x [M, K] -> [M, N]: fp32 weight [N, K]; or the W4A8 draft twin (packed
// [N, K/2], scale/zero [N, K/G]); or the INT8 target twin (int8 [N, K], fp32 scale [N]), run
// as `Int8Linear` runs a step's rows: W8A32 (linear.h) or, with int8 activations (`a8`),
// W8A8 (int_dot.h). The cores the entry points (`linear_rows_cpu`, `int4_rows_cpu`, ...) call,
// on the team's threads; the tensors are checked and made contiguous fp32 when added.
struct Projection {
  at::Tensor weight, packed, scale, zero, int8, bias;
  // `weight` as bf16, where its fp32 numbers are bf16 numbers (a bf16 checkpoint loaded in
  // fp32): the same bits for half the bytes read, while `weight` is the tensor copied: the
  // same storage (`compact_source`) at the same version (`compact_version`). After a change
  // the fp32 weight is read until the runner builds the stack again (`CpuRunner.rebuild`).
  // A bf16 weight held as such (`kernel_table.holds_bf16`): `compact` is the weight itself,
  // always read (there is no fp32 weight to fall back to).
  at::Tensor compact;
  uint32_t compact_version = 0;
  const void* compact_source = nullptr;
  int64_t group_size = 0, N = 0, K = 0;
  bool a8 = false, held_bf16 = false;

  // Whether a forward may read `compact` now. (A change through `.data` that keeps the
  // storage, e.g. `w.data.mul_()`, bumps no version: such edits need a rebuild.)
  bool compact_current() const {
    if (held_bf16) return true;
    // (`compact` is never set for an inference tensor, which has no version counter)
    return compact.defined() && weight.data_ptr() == compact_source &&
           weight._version() == compact_version;
  }

  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }

  // out [M, N] = x [M, K] through this layer: this thread's share of the outputs
  // use_compact: read `compact` (the forward's `compact_current()`, taken once before its team)
  template <class For>
  void run(const float* x, int64_t M, float* out, const For& f, bool use_compact) const {
    if (packed.defined()) {
      intdot::int4_rows(x, M, K, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                        zero.data_ptr<float>(), group_size, bias_ptr(), N, out, f);
    } else if (int8.defined() && a8) {
      intdot::w8a8_rows(x, M, K, int8.data_ptr<int8_t>(), scale.data_ptr<float>(), bias_ptr(),
                        N, out, f);
    } else if constexpr (simd::kVectorF8) {
      if (int8.defined())
        rowlinear::rows(x, int8.data_ptr<int8_t>(), scale.data_ptr<float>(), bias_ptr(), out, M,
                        K, N, f);
      else if (use_compact)
        rowlinear::rows(x, compact.data_ptr<c10::BFloat16>(), nullptr, bias_ptr(), out, M, K, N,
                        f);
      else
        rowlinear::rows(x, weight.data_ptr<float>(), nullptr, bias_ptr(), out, M, K, N, f);
    } else if (f.id() == 0) {
      // Portable builds: the few-row linear's loop is vectorized by the compiler its own way,
      // which may differ between translation units, so the layer loop's bits come from its
      // own entry point (linear.cpp), on one thread (these builds are the slow fallback).
      const auto xt = at::from_blob(const_cast<float*>(x), {M, K}, at::kFloat);
      const c10::optional<at::Tensor> b = bias.defined() ? c10::optional<at::Tensor>(bias)
                                                          : c10::nullopt;
      const auto y = int8.defined() ? int8_rows_cpu(xt, int8, scale, b)
                                    : linear_rows_cpu(xt, weight, b);
      std::memcpy(out, y.data_ptr<float>(), sizeof(float) * M * N);
    }
  }
};

at::Tensor fp32_or_undefined(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  return t->to(at::kFloat).contiguous();
}

// What a layer computes besides its seven projections (`LayerSpec` in
// qspec_core/families/spec.py; `cpu_stack.py` fills it from the model):
//   input_norm      before the attention (pre and sandwich placements; undefined: post)
//   post_norm       pre: the MLP's input norm, after the residual add; post and sandwich
//                   (`branch_norms`): the attention branch's output, before the add
//   pre_ff_norm     sandwich: the MLP's input norm (post: the MLP reads the stream itself)
//   post_ff_norm    post and sandwich: the MLP branch's output, before the add
//   q_norm, k_norm  RMSNorms of q and k before RoPE: over each head (`qk_per_head`, Qwen3,
//                   Gemma 3) or over the whole projection (OLMo 2)
//   q_scale         q times this after RoPE (Gemma's query_pre_attn_scalar; 1: none)
//   gelu_tanh       the MLP's act: GELU (tanh) instead of SiLU
//   local_rope      rotates with the second cos/sin of the forward (Gemma 3's sliding layers)
// Every norm weight is fp32 as the layer loop's ops read it (Gemma's 1 + w made once by the
// builder). Each step is the kernel the layer loop's ops call (`CpuOps`), in its order, so the
// two give the same bits.
struct Layer {
  at::Tensor input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm;
  Projection q, k, v, o, gate, up, down;
  bool qk_per_head = false, gelu_tanh = false, local_rope = false;
  double q_scale = 1.0;

  bool branch_norms() const { return post_ff_norm.defined(); }

  // the projections in the order they are added and indexed (q k v o gate up down)
  std::array<const Projection*, 7> projections() const {
    return {&q, &k, &v, &o, &gate, &up, &down};
  }
};

at::Tensor norm_weight(const c10::optional<at::Tensor>& w, int64_t size, const char* name) {
  if (!w.has_value() || !w->defined()) return at::Tensor();
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == size, name,
              ": fp32 contiguous, ", size, " weights");
  return *w;
}

}  // namespace

class DecoderStack {
 public:
  DecoderStack(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps)
      : H_(n_heads), n_kv_(n_kv_heads), D_(head_dim), eps_(eps) {}

  // The next projection of the layer being built, in the order q, k, v, o, gate, up, down:
  // an fp32 weight, or a bf16 one held as such (vector builds: the same bits as its upcast).
  // compact: `weight` as bf16, holding the same numbers (the caller checked), read instead of
  // it while `weight` is unchanged; vector builds only (Projection::run: the portable loop's
  // bits may depend on the weight type)
  void add_linear(at::Tensor weight, c10::optional<at::Tensor> bias,
                  c10::optional<at::Tensor> compact) {
    Projection p;
    p.weight = weight, p.bias = fp32_or_undefined(bias);
    p.N = weight.size(0), p.K = weight.size(1);
    if (weight.scalar_type() == at::kBFloat16) {  // held as bf16: no fp32 weight, no copy
      TORCH_CHECK(simd::kVectorF8 && weight.is_contiguous(),
                  "a bf16 weight needs a vector build and a contiguous tensor");
      p.compact = weight, p.held_bf16 = true;
      pending_.push_back(p);
      return;
    }
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(),
                "fp32 or bf16 contiguous weights only");
    // (an inference tensor has no version counter: no copy)
    if (simd::kVectorF8 && compact.has_value() && compact->defined() && !weight.is_inference()) {
      TORCH_CHECK(compact->scalar_type() == at::kBFloat16 && compact->is_contiguous() &&
                      compact->sizes() == weight.sizes(),
                  "compact: bf16 contiguous, the weight's shape");
      p.compact = *compact, p.compact_version = weight._version();
      p.compact_source = weight.data_ptr();
    }
    pending_.push_back(p);
  }

  // How many projections a forward would read as bf16 copies now (tests, the bench).
  int64_t compact_count() const {
    int64_t n = 0;
    for (const Layer& L : layers_)
      for (const Projection* p : L.projections()) n += p->compact_current();
    return n;
  }

  void add_int4_linear(at::Tensor packed, at::Tensor scale, at::Tensor zero,
                       int64_t group_size, c10::optional<at::Tensor> bias) {
    const int64_t N = packed.size(0), K = packed.size(1) * 2;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
                "packed uint8 contiguous [N, K/2]");
    TORCH_CHECK(group_size > 0 && K % intdot::CHUNK == 0 && group_size % intdot::CHUNK == 0 &&
                    K % group_size == 0,
                "K and the group size must be multiples of 64");
    TORCH_CHECK(scale.numel() == N * (K / group_size) && zero.numel() == N * (K / group_size),
                "scale and zero [N, K/G]");
    Projection p;
    p.packed = packed, p.scale = scale.to(at::kFloat).contiguous();
    p.zero = zero.to(at::kFloat).contiguous(), p.group_size = group_size;
    p.bias = fp32_or_undefined(bias), p.N = N, p.K = K;
    pending_.push_back(p);
  }

  // int8_activations: round x to int8 per 64 inputs (W8A8) instead of keeping it fp32 (W8A32)
  void add_int8_linear(at::Tensor weight_int8, at::Tensor weight_scale,
                       c10::optional<at::Tensor> bias, bool int8_activations) {
    TORCH_CHECK(weight_scale.scalar_type() == at::kFloat, "fp32 INT8 scales only");
    TORCH_CHECK(weight_int8.scalar_type() == at::kChar && weight_int8.is_contiguous() &&
                    weight_scale.numel() == weight_int8.size(0),
                "int8 contiguous [N, K] with a scale [N]");
    TORCH_CHECK(!int8_activations || weight_int8.size(1) % intdot::CHUNK == 0,
                "W8A8: K must be a multiple of 64");
    Projection p;
    p.int8 = weight_int8, p.scale = weight_scale.contiguous(), p.a8 = int8_activations;
    p.bias = fp32_or_undefined(bias), p.N = weight_int8.size(0), p.K = weight_int8.size(1);
    pending_.push_back(p);
  }

  // Closes a layer: its norms and kinds (`Layer`) and the seven projections added since the
  // last one.
  void add_layer(c10::optional<at::Tensor> input_norm, at::Tensor post_norm,
                 c10::optional<at::Tensor> pre_ff_norm, c10::optional<at::Tensor> post_ff_norm,
                 c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                 bool qk_per_head, double q_scale, bool gelu_tanh, bool local_rope) {
    TORCH_CHECK(pending_.size() == 7, "a layer takes 7 projections, got ", pending_.size());
    const Projection &q = pending_[0], &k = pending_[1], &v = pending_[2], &o = pending_[3];
    const Projection &gate = pending_[4], &up = pending_[5], &down = pending_[6];
    TORCH_CHECK(q.N == H_ * D_ && k.N == n_kv_ * D_ && v.N == n_kv_ * D_ && o.K == H_ * D_ &&
                    q.K == o.N && k.K == q.K && v.K == q.K && gate.K == q.K && up.K == q.K &&
                    gate.N == up.N && down.K == gate.N && down.N == q.K,
                "the projections' shapes do not make a decoder layer");
    const int64_t hidden = q.K;
    Layer L{norm_weight(input_norm, hidden, "input_norm"),
            norm_weight(post_norm, hidden, "post_norm"),
            norm_weight(pre_ff_norm, hidden, "pre_ff_norm"),
            norm_weight(post_ff_norm, hidden, "post_ff_norm"),
            norm_weight(q_norm, qk_per_head ? D_ : H_ * D_, "q_norm"),
            norm_weight(k_norm, qk_per_head ? D_ : n_kv_ * D_, "k_norm"),
            pending_[0], pending_[1], pending_[2], pending_[3], pending_[4], pending_[5],
            pending_[6]};
    TORCH_CHECK(L.post_norm.defined(), "post_norm: every layer has one");
    TORCH_CHECK(L.q_norm.defined() == L.k_norm.defined(), "q_norm and k_norm come together");
    // pre: input + post; post: post + post_ff; sandwich: all four
    TORCH_CHECK(L.branch_norms() ? !L.pre_ff_norm.defined() || L.input_norm.defined()
                                 : L.input_norm.defined() && !L.pre_ff_norm.defined(),
                "the norms make no placement (pre, post or sandwich)");
    L.qk_per_head = qk_per_head, L.q_scale = q_scale, L.gelu_tanh = gelu_tanh;
    L.local_rope = local_rope;
    layers_.push_back(L);
    pending_.clear();
  }

  int64_t size() const { return int64_t(layers_.size()); }

  // One forward through every layer over a cache's C++ object (kv_cache.h), which writes each
  // layer's new K/V into the cache and attends over it, with the step the cache filled.
  // cos/sin [T, r] (r <= D: a partial rotary rotates each head's first r channels);
  // local_cos/local_sin the local layers' (`Layer::local_rope`; None when no layer is)
  at::Tensor run_hier(at::Tensor x, at::Tensor cos, at::Tensor sin, const HierKV& cache,
                      const HierStep& step, c10::optional<at::Tensor> local_cos,
                      c10::optional<at::Tensor> local_sin) {
    return run_cached(x, Rotations{cos, sin, local_cos, local_sin}, cache, step, step.lo);
  }

  at::Tensor run_full(at::Tensor x, at::Tensor cos, at::Tensor sin, const FullKV& cache,
                      const FullStep& step, c10::optional<at::Tensor> local_cos,
                      c10::optional<at::Tensor> local_sin) {
    return run_cached(x, Rotations{cos, sin, local_cos, local_sin}, cache, step, step.start);
  }

 private:
  struct Rotations {
    at::Tensor cos, sin;
    c10::optional<at::Tensor> local_cos, local_sin;
  };

  // run over `cache`, each layer's new K/V written from token `first` of its region (the
  // hierarchical cache's full-precision region, the full cache's rows)
  template <class Cache, class Step>
  at::Tensor run_cached(const at::Tensor& x, const Rotations& rot, const Cache& cache,
                        const Step& step, int64_t first) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3,
                "x must be contiguous fp32 [B, T, hidden]");
    TORCH_CHECK(x.size(0) * x.size(1) <= kMaxStepRows, "a decode step: at most ", kMaxStepRows,
                " tokens");
    TORCH_CHECK(pending_.empty(), "a layer is half built");
    const int64_t B = x.size(0), T = x.size(1), M = B * T, hidden = x.size(2);
    TORCH_CHECK(size() == 0 || layers_[0].q.K == hidden, "x [B, T, hidden] of the layers' size");
    int64_t inter = 0;
    // which projections read their bf16 copies in this forward, decided once here (q k v o
    // gate up down per layer): the team's threads only read it
    std::vector<uint8_t> compact(7 * layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      TORCH_CHECK(!L.q.packed.defined() || M <= 8, "the W4A8 draft layers take at most 8 rows");
      inter = std::max(inter, L.gate.N);
      TORCH_CHECK(!L.local_rope || (rot.local_cos.has_value() && rot.local_sin.has_value()),
                  "a local layer needs the local cos/sin");
      int j = 0;
      for (const Projection* p : L.projections()) compact[7 * l + j++] = p->compact_current();
    }
    // every buffer the team writes, made before it starts (its threads only run kernels)
    auto h = at::empty({M, hidden}, at::kFloat), y = at::empty({M, hidden}, at::kFloat);
    auto proj = at::empty({M, hidden}, at::kFloat);  // the output projection, then the MLP's
    auto q = at::empty({B, T, H_, D_}, at::kFloat), out = at::empty({B, T, H_, D_}, at::kFloat);
    auto k = at::empty({B, T, n_kv_, D_}, at::kFloat), v = at::empty({B, T, n_kv_, D_}, at::kFloat);
    auto gate = at::empty({M * inter}, at::kFloat), up = at::empty({M * inter}, at::kFloat);
    auto act = at::empty({M * inter}, at::kFloat);  // (a layer of N outputs: views [M, N])
    float* rows = x.data_ptr<float>();  // the residual stream [M, hidden], updated in place
    const float eps = float(eps_);

    // layer l's input norm, q/k/v projections, q/k norms, RoPE and query scale
    auto before_attention = [&](const team::Member& t, int64_t l) {
      const Layer& L = layers_[l];
      const uint8_t* c = compact.data() + 7 * l;
      const float* in = rows;  // (post-norm layers: the stream itself)
      if (L.input_norm.defined()) {
        t.single([&] { norm_rows(rows, L.input_norm.data_ptr<float>(), h.data_ptr<float>(), M,
                                 hidden, eps); });
        in = h.data_ptr<float>();
      }
      L.q.run(in, M, q.data_ptr<float>(), t, c[0]);
      L.k.run(in, M, k.data_ptr<float>(), t, c[1]);
      L.v.run(in, M, v.data_ptr<float>(), t, c[2]);
      t.barrier();
      t.single([&] {
        if (L.q_norm.defined()) {  // in place, [M, H D] rows or [M H, D] heads
          const int64_t qn = L.qk_per_head ? D_ : H_ * D_, kn = L.qk_per_head ? D_ : n_kv_ * D_;
          float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
          norm_rows(qp, L.q_norm.data_ptr<float>(), qp, M * H_ * D_ / qn, qn, eps);
          norm_rows(kp, L.k_norm.data_ptr<float>(), kp, M * n_kv_ * D_ / kn, kn, eps);
        }
        const at::Tensor& cs = L.local_rope ? *rot.local_cos : rot.cos;
        const at::Tensor& sn = L.local_rope ? *rot.local_sin : rot.sin;
        rope_cpu(q, cs, sn);
        rope_cpu(k, cs, sn);
        if (L.q_scale != 1.0) q.mul_(L.q_scale);  // (torch's kernel, as the loop's q * scale)
      });
    };
    // layer l's output projection of the attention's output `out` [B, T, H, D], then its MLP
    auto after_attention = [&](const team::Member& t, int64_t l) {
      const Layer& L = layers_[l];
      const uint8_t* c = compact.data() + 7 * l;
      L.o.run(out.data_ptr<float>(), M, proj.data_ptr<float>(), t, c[3]);
      t.barrier();
      const float* mlp_in = y.data_ptr<float>();
      t.single([&] {
        float* pp = proj.data_ptr<float>();
        if (!L.branch_norms()) {  // rows += o(out), y = norm(rows)
          add_norm_rows(rows, pp, L.post_norm.data_ptr<float>(), y.data_ptr<float>(), M, hidden,
                        eps);
          return;
        }
        // rows += norm(o(out)), then y = norm(rows) (sandwich) or the MLP reads rows (post)
        norm_rows(pp, L.post_norm.data_ptr<float>(), pp, M, hidden, eps);
        x.view({M, hidden}).add_(proj);
        if (L.pre_ff_norm.defined())
          norm_rows(rows, L.pre_ff_norm.data_ptr<float>(), y.data_ptr<float>(), M, hidden, eps);
      });
      if (L.branch_norms() && !L.pre_ff_norm.defined()) mlp_in = rows;
      const int64_t I = L.gate.N;
      auto g = gate.narrow(0, 0, M * I).view({M, I}), u = up.narrow(0, 0, M * I).view({M, I});
      auto a = act.narrow(0, 0, M * I).view({M, I});
      L.up.run(mlp_in, M, u.data_ptr<float>(), t, c[5]);
      L.gate.run(mlp_in, M, g.data_ptr<float>(), t, c[4]);
      t.barrier();
      t.single([&] {
        if (L.gelu_tanh)
          at::gelu_out(a, g, "tanh").mul_(u);
        else
          at::silu_out(a, g).mul_(u);
      });
      L.down.run(a.data_ptr<float>(), M, proj.data_ptr<float>(), t, c[6]);
      t.barrier();
      t.single([&] {
        if (L.post_ff_norm.defined()) {
          float* pp = proj.data_ptr<float>();
          norm_rows(pp, L.post_ff_norm.data_ptr<float>(), pp, M, hidden, eps);
        }
        x.view({M, hidden}).add_(proj);
      });
    };
    // the cache's object writes layer l's k/v, then attends [B, H, T, D]
    auto attend = [&](int64_t l) {
      if constexpr (std::is_same_v<Cache, FullKV>)  // (a local layer's slots from its base)
        cache.write(l, k.transpose(1, 2), v.transpose(1, 2), first, step.local_base);
      else
        cache.write(l, k.transpose(1, 2), v.transpose(1, 2), first);
      return cache.attention(l, q.transpose(1, 2), step);
    };

    const int threads = at::get_num_threads();
    if constexpr (std::is_same_v<Cache, HierKV>) {
      // one team for the whole forward: the attention's tasks are shared out like a kernel's
      // outputs, between its set-up and its merge on thread 0
      std::optional<HierAttention> attention;
      team::run(threads, [&](const team::Member& t) {
        for (int64_t l = 0; l < size(); ++l) {
          if (l == 0) before_attention(t, 0);
          t.single([&] { attention.emplace(attend(l)); });
          if (!t.failed())
            t(0, attention->tasks(), 1, [&](int64_t b0, int64_t b1) { attention->run(b0, b1); });
          t.barrier();
          t.single([&] { attention->finish_into(out.data_ptr<float>()); });
          after_attention(t, l);
          if (l + 1 < size()) before_attention(t, l + 1);
        }
      });
    } else {
      // a team from each attention to the next; the attention (SDPA) runs on torch's pool
      if (size() > 0) team::run(threads, [&](const team::Member& t) {
        before_attention(t, 0);
      });
      for (int64_t l = 0; l < size(); ++l) {
        out = attend(l).transpose(1, 2).contiguous();  // [B, T, H, D]
        team::run(threads, [&](const team::Member& t) {
          after_attention(t, l);
          if (l + 1 < size()) before_attention(t, l + 1);
        });
      }
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
      .def("add_linear", &DecoderStack::add_linear, pybind11::arg("weight"),
           pybind11::arg("bias"), pybind11::arg("compact") = pybind11::none())
      .def("compact_count", &DecoderStack::compact_count)
      .def("add_int4_linear", &DecoderStack::add_int4_linear)
      .def("add_int8_linear", &DecoderStack::add_int8_linear)
      .def("add_layer", &DecoderStack::add_layer, pybind11::arg("input_norm"),
           pybind11::arg("post_norm"), pybind11::arg("pre_ff_norm") = pybind11::none(),
           pybind11::arg("post_ff_norm") = pybind11::none(),
           pybind11::arg("q_norm") = pybind11::none(), pybind11::arg("k_norm") = pybind11::none(),
           pybind11::arg("qk_per_head") = false, pybind11::arg("q_scale") = 1.0,
           pybind11::arg("gelu_tanh") = false, pybind11::arg("local_rope") = false)
      .def("__len__", &DecoderStack::size)
      // (the forward touches no Python object: other threads may run meanwhile)
      // run(x, cos, sin, cache, step[, local_cos, local_sin]): a `HierKV` with its
      // `HierStep`, or a `FullKV` with its `FullStep` (the cache's `native` and `native_step`)
      .def("run", &DecoderStack::run_hier, pybind11::arg("x"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("cache"), pybind11::arg("step"),
           pybind11::arg("local_cos") = pybind11::none(),
           pybind11::arg("local_sin") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run", &DecoderStack::run_full, pybind11::arg("x"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("cache"), pybind11::arg("step"),
           pybind11::arg("local_cos") = pybind11::none(),
           pybind11::arg("local_sin") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
