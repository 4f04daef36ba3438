// The caches' side of the C++ line: what a KV cache hands the kernels, named.
//
// A cache on the CPU owns one of these objects over its own buffers (made by
// qspec_core/cache/hierarchical.py or full.py, bound once in module.cpp) and fills one step
// struct per forward. The object is the one writer of a step's new K/V into the buffers and
// runs the attention over them, for the cache's per-layer `attend` and for `DecoderStack`
// (step.cpp) alike: the stack receives the object and the step, never the buffers.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <vector>

// One layer of the hierarchical cache as the attention reads it (slices, no copies): planes
// [B, n_kv, S, D/2] uint8; k_scale/k_zero [B, n_kv, S/G, D] fp32; v_scale/v_zero
// [B, n_kv, S, D/G] fp32; fp_k/fp_v [B, n_kv, n_fp, D] fp32, stride 1 along D.
struct HierLayer {
  at::Tensor k_upper, k_lower, k_scale, k_zero;
  at::Tensor v_upper, v_lower, v_scale, v_zero;
  at::Tensor fp_k, fp_v;
};

// One forward over the hierarchical cache, the same for every layer (the cache's bookkeeping,
// `HierarchicalKVCache.native_step` or `attend`).
struct HierStep {
  int64_t lo = 0;        // the step's T tokens go to [lo, lo + T) of the full-precision region
  int64_t n_fp = 0;      // the region's valid length once they are written
  int64_t n_quant = 0;   // the quantized length: the region's first position
  at::Tensor n_quant_q;  // [T] int: the quantized history each query sees
  at::Tensor shift;      // [T] int: region keys a query skips (a late query's F1, read quantized)
  at::Tensor input_pos;  // [T] int: the queries' positions
  bool int8 = false;     // both planes (the target's view), else the upper plane only
  bool int_queries = false;  // queries rounded to int16, integer-dot scores (attention_int.h)
  // Gemma 2's attn_logit_softcapping: each scaled score s becomes cap * tanh(s / cap) before
  // the softmax; 0: none
  float softcap = 0.f;
  // [T] int, or undefined: a chain (row t sees rows <= t of this forward). A token tree's
  // verify: row t's parent row (< t; -1: a root, which sees only the keys before the
  // forward's rows); row t sees the keys before the forward's rows, then its path from its
  // root, at the positions input_pos gives (its depth); row 0 is a root.
  at::Tensor parents;
  // The position a local layer's planes begin at (a multiple of G; 0 for global layers):
  // a sliding-window layer keeps only the history its queries can still see
  // (`HierarchicalKVCache`'s local stack), in step over the local layers.
  int64_t local_base = 0;
};

// One layer's attention over the hierarchical cache in three phases, so that a team of
// threads (step.cpp) can share the middle one: the construction reorders the queries and
// makes the buffers (one thread), `run` computes tasks [begin, end) of [0, tasks()) (any
// split over threads: a task's partials do not depend on it), `finish` merges the tasks'
// partials in a fixed order (one thread) -> [B, H, T, D] fp32, a view of a [B, T, H, D] buffer.
class HierAttention {
 public:
  // window: the layer's sliding window (query at p sees positions > p - window; 0: none).
  // base: the position the layer's planes begin at (a local layer's dropped history; a
  // multiple of G, at most any query's oldest visible position). Positions stay absolute, so
  // the tasks' chunks, and the bits, do not depend on it.
  HierAttention(const at::Tensor& q, const HierLayer& layer, const HierStep& step,
                int64_t group_size, int64_t chunk, int64_t window = 0, int64_t base = 0);
  HierAttention(HierAttention&&) noexcept;
  HierAttention& operator=(HierAttention&&) noexcept;
  ~HierAttention();
  int64_t tasks() const;
  void run(int64_t begin, int64_t end) const;
  at::Tensor finish() const;
  void finish_into(float* out) const;  // into out [B, T, H, D] (contiguous)

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Every task on torch's thread pool, then the merge.
at::Tensor run_on_pool(const HierAttention& attention);

// The hierarchical cache's buffers: planes [Lg, B, n_kv, S, D/2] uint8, K metadata
// [Lg, B, n_kv, S/G, D], V metadata [Lg, B, n_kv, S, D/G] of its global layers (all layers
// when none is local), fp_k/fp_v [L, B, n_kv, 3G, D] fp32 of all; each layer's sliding window
// (windows [L], 0: a global layer; empty: every layer global), which its attention applies;
// and the local layers' planes, a second stack `local` (the 8 plane tensors in the same order,
// [Ll, B, n_kv, Sw, ...]: a window's worth of positions from HierStep::local_base on; empty
// when no layer is local). slots [L]: each layer's index in its stack (empty: the identity).
class HierKV {
 public:
  HierKV(at::Tensor k_upper, at::Tensor k_lower, at::Tensor k_scale, at::Tensor k_zero,
         at::Tensor v_upper, at::Tensor v_lower, at::Tensor v_scale, at::Tensor v_zero,
         at::Tensor fp_k, at::Tensor fp_v, int64_t group_size, int64_t chunk,
         std::vector<int64_t> windows = {}, std::vector<at::Tensor> local = {},
         std::vector<int64_t> slots = {});
  // k/v [B, n_kv, T, D] (any strides) -> fp_k/fp_v[layer, :, :, lo : lo + T]
  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, int64_t lo) const;
  // q [B, H, T, D] over the layer's planes and region [0, step.n_fp) -> [B, H, T, D] fp32
  at::Tensor attend(int64_t layer, const at::Tensor& q, const HierStep& step) const;
  // the same, in phases (on torch's pool, `attend` runs the tasks and finishes)
  HierAttention attention(int64_t layer, const at::Tensor& q, const HierStep& step) const;
  int64_t group_size() const { return group_size_; }
  int64_t chunk() const { return chunk_; }

 private:
  HierLayer all_;    // the global stack [Lg, ...] (fp_k/fp_v: [L, ...])
  HierLayer local_;  // the local stack [Ll, ...] (fp_k/fp_v unused), or undefined
  int64_t group_size_, chunk_;
  std::vector<int64_t> windows_;  // [L] or empty
  std::vector<int64_t> slots_;    // [L] or empty
};

// One forward over the full-precision cache: positions [start, end), the attention mask (none
// with is_causal), as `kernels.reference.causal_attention` calls SDPA.
struct FullStep {
  int64_t start = 0, end = 0;
  c10::optional<at::Tensor> mask;
  bool is_causal = false;
  // a local layer's (FullKV's windows): its keys [local_start, end) and their mask, positions
  // counted from local_start (-1: no window hides a key in this forward, every layer as above)
  int64_t local_start = -1;
  c10::optional<at::Tensor> local_mask;
  // the position a local layer's slot 0 holds (FullKV's local stack; 0 when none dropped)
  int64_t local_base = 0;
};

// The full-precision cache's k/v [Lg, B, n_kv, S, D] fp32; each layer's sliding window
// (windows [L], 0: a global layer; empty: all global), which its attention applies from a
// step's local_start; softcap: Gemma 2's cap on the scaled scores (0: none), which takes the
// reference's written-out attention (`kernels.reference._softcapped_attention`, op for op).
// local_k/local_v [Ll, B, n_kv, Sw, D]: the sliding-window layers' own stack, a window's worth
// of positions from a step's local_base on (undefined: every layer in k/v); slots [L]: each
// layer's index in its stack (empty: the identity).
class FullKV {
 public:
  FullKV(at::Tensor k, at::Tensor v, std::vector<int64_t> windows = {}, double softcap = 0.0,
         at::Tensor local_k = {}, at::Tensor local_v = {}, std::vector<int64_t> slots = {});
  // k/v [B, n_kv, T, D] -> the layer's positions [start, start + T), a local layer's slot 0
  // holding position local_base
  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v, int64_t start,
             int64_t local_base = 0) const;
  // q [B, H, T, D] over keys [0, step.end) -> [B, H, T, D]
  at::Tensor attend(int64_t layer, const at::Tensor& q, const FullStep& step) const;
  at::Tensor attention(int64_t layer, const at::Tensor& q, const FullStep& step) const {
    return attend(layer, q, step);  // (SDPA: no phases to share out)
  }

 private:
  bool is_local(int64_t layer) const {
    return local_k_.defined() && !windows_.empty() && windows_.at(layer);
  }
  // the layer's k and v in its stack, [B, n_kv, S, D]
  std::pair<at::Tensor, at::Tensor> stack(int64_t layer) const;

  at::Tensor k_, v_, local_k_, local_v_;
  std::vector<int64_t> windows_;  // [L] or empty
  std::vector<int64_t> slots_;    // [L] or empty
  double softcap_;
};

// hier_attention.cpp: the kernel over one layer; fp_pos0 = step.n_quant, and step.lo unused.
// Returns [B, H, T, D] fp32, a view of a [B, T, H, D] buffer.
at::Tensor hier_attention_cpu(const at::Tensor& q, const HierLayer& layer, const HierStep& step,
                              int64_t group_size, int64_t chunk, int64_t window = 0,
                              int64_t base = 0);
