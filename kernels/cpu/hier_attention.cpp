// Flash-decoding over the hierarchical INT4/INT8 KV cache, for CPUs.
//
// The twin of kernels/triton/hier_attention.py (Triton) with the same arguments, for the CPU
// that has no Triton: the packed nibble planes are decoded a block of tokens at a time into a
// small float buffer in L1 and consumed at once, so no full-precision copy of the history is
// ever built. Work splits into (batch x KV head x chunk of history) tasks over torch's thread
// pool, each leaving softmax partials (acc, max, sum) that a final pass merges by log-sum-exp;
// the full-precision region is one more task per head.
//
// Two implementations of a task: the SIMD layer's attention ops (simd::Attn: AVX2/FMA and
// AVX-512 builds) for head_dim 64 and 128 (the models qspec runs), and portable C++ for the rest
// and for the builds without those ops. Both fold each row's
// keys in the same order, so a query's result does not depend on how many queries came with
// it (greedy QuantSpec relies on a verify row equalling the autoregressive step bit for bit).
//
// Layout (one layer): q [B, H, T, D]; planes [B, n_kv, S, D/2] uint8 with dim 2i in the low
// nibble of byte i and 2i+1 in the high one; k_scale/k_zero [B, n_kv, S/G, D] (keys per
// channel per G tokens); v_scale/v_zero [B, n_kv, S, D/G] (values per token per G channels);
// fp_k/fp_v [B, n_kv, F, D] fp32, any strides but the last. Inside, a head's dims are kept
// "deinterleaved" per segment of W = 64 dims (W = D when 64 does not divide D): a segment's
// even dims, then its odd dims, so that a byte's two nibbles land in two contiguous runs and
// every inner loop is stride 1. q, the K metadata and the output are permuted alike.
#include <ATen/ATen.h>

#include "kernels.h"  // (the declarations these definitions must match)
#include "attention_int.h"
#include "attention_math.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

using namespace attn;

constexpr int64_t BLOCK = kMaxBlock;  // tokens decoded together (fewer when G < 32)

struct Args {
  const float* q;  // [B * n_kv, R * T, D] scaled by 1/sqrt(D), deinterleaved
  const uint8_t *ku, *kl, *vu, *vl;
  const float *ks, *kz, *vs, *vz;
  const float *fk, *fv;
  int64_t fk_b, fk_h, fk_t, fv_b, fv_h, fv_t;  // fp region strides (elements)
  const int64_t *nq, *fp_lo, *pos;
  // a token tree's rows (HierStep::parents): each row's path from its root, paths[t * T + i]
  // the row at depth i, and depth[t]; nullptr: a chain
  const int64_t *paths, *depth;
  const int64_t* perm;  // [D] deinterleaved position -> original dim
  int64_t B, n_kv, R, T, D, S, G, n_fp, fp_pos0, chunk, n_chunks, max_nq;
  bool target, int_queries;
  float softcap;  // HierStep::softcap (0: none)
  int64_t window;  // a local layer's sliding window (HierKV's; 0: none)
  int64_t base;    // the position the planes begin at (a local layer's dropped history)
};

// The first position query t may see: pos - window + 1 under a sliding window, else 0. A
// function of the row's position alone (the bits' batch invariance holds).
inline int64_t oldest(const Args& a, int64_t t) {
  return a.window ? a.pos[t] - a.window + 1 : 0;
}

// Online-softmax state of the R*T query rows of one KV head over one task's keys.
struct Rows {
  int64_t RT, D;
  float* __restrict acc;  // [RT, D]
  float* __restrict m;    // [RT]
  float* __restrict l;    // [RT]
};

// Deinterleaved position p -> the original dim it holds.
inline int64_t original_dim(int64_t p, int64_t D) {
  const int64_t W = segment_width(D), hw = W / 2, s = p / W, w = p % W;
  return s * W + (w < hw ? 2 * w : 2 * (w - hw) + 1);
}

// ------------------------------------------------------------------------------ tasks

// Asks for `bytes` of each plane the view reads, from token row `row` on (isa.h: into L2).
inline void prefetch_block(const Args& a, int64_t row, int64_t bytes, bool target) {
  const int64_t at = row * (a.D / 2);
  for (int64_t o = 0; o < bytes; o += 64) {
    prefetch_l2(a.ku + at + o);
    prefetch_l2(a.vu + at + o);
    if (target) {
      prefetch_l2(a.kl + at + o);
      prefetch_l2(a.vl + at + o);
    }
  }
}

// The quantized history, with the dequantization folded into the math instead of the data:
//   K (per channel): q . k_j = sum_d (q_d s_d) c_jd + sum_d q_d z_d, so q is scaled once per
//     K group and the dot runs on the raw codes c (in float, or in integers when INTQ: q s
//     rounded to int16 per row, attention_int.h);
//   V (per token, one group): sum_j p_j (s_j c_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j.
// Codes are U (draft) or 16 U + L (target, with s / 16 as the step). The AVX2 decoder gives
// the target 16 U + (L + 8), so its zeros absorb -8 steps (`off`).
// DT: head_dim known at compile time (64, 128: the vector paths), 0 for the portable one.
// A: the SIMD layer's attention ops (A::kVector: whether this build has them).
template <int64_t DT, bool TARGET, bool INTQ, class A = simd::Attn>
void quantized_task(const Args& a, int64_t bh, int64_t c, Rows& rows) {
  constexpr bool FAST = DT != 0 && A::kVector;
  const int64_t D = DT ? DT : a.D, half = D / 2, G = a.G, RT = rows.RT;
  const int64_t start = c * a.chunk, stop = std::min(start + a.chunk, a.max_nq);
  const float div = TARGET ? 16.f : 1.f;
  const float off = FAST && TARGET ? 8.f : 0.f;  // codes the decoder leaves + 8 too high
  const int64_t vgroups = D / G;
  // a block must not straddle two K groups: the largest divisor of G up to BLOCK (G = 80, a
  // head_dim-80 model's default, took blocks of 32 and read tokens 64..95 with group 0's scales)
  int64_t block = std::min(BLOCK, G);
  while (G % block) --block;
  alignas(32) float kb[BLOCK * 128], vb[BLOCK * 128];
  std::vector<float> big;  // portable path, head_dim > 128
  float *kbp = kb, *vbp = vb;
  if (D > 128) {
    big.resize(2 * BLOCK * D);
    kbp = big.data(), vbp = big.data() + BLOCK * D;
  }
  alignas(32) float vscale[BLOCK], vzero[BLOCK];
  // Rows whose values are folded together (fold_values): each row's scores, then weights,
  // wait in its own pw slot until KR rows are ready (or the block's rows are done).
  constexpr int KR = fold_rows<A>();
  alignas(64) float pw[KR][BLOCK];
  float corr[KR];
  const float* wrow[KR];
  float* arow[KR];
  std::vector<float> qs(INTQ ? 0 : RT * D), kbias(RT), zacc(RT, 0.f);
  IntQueries iq;
  std::vector<int32_t> dots(INTQ ? RT * BLOCK : 0);
  std::vector<char> sees(RT);
  std::vector<int64_t> hide(RT, 0);  // per row, the block's keys below its window
  const float* q = a.q + bh * RT * D;
  int64_t group = -1;
  int64_t first = start;  // under a window, no row sees the blocks before its oldest position
  if (a.window) {
    int64_t lo = a.max_nq;
    for (int64_t t = 0; t < a.T; ++t) lo = std::min(lo, oldest(a, t));
    if (lo > start) first = start + (lo - start) / block * block;  // (the same block grid)
  }
  for (int64_t b0 = first; b0 < stop; b0 += block) {
    const int64_t n = std::min(block, stop - b0);
    bool any = false;
    for (int64_t r = 0; r < RT; ++r) {  // history is all-or-nothing per G-aligned block,
      const int64_t t = r % a.T;       // but for the keys a window hides
      hide[r] = std::clamp<int64_t>(oldest(a, t) - b0, 0, n);
      sees[r] = b0 < a.nq[t] && hide[r] < n;
      any |= sees[r];
    }
    if (!any) continue;
    const int64_t g = b0 / G;  // a block lies within one K group
    if (g != group) {
      group = g;
      const float* ks = a.ks + (bh * (a.S / G) + g - a.base / G) * D;
      const float* kz = a.kz + (bh * (a.S / G) + g - a.base / G) * D;
      if ((g + 1) * G < stop) {  // the next group's scales and zeros, asked for a group ahead:
        for (int64_t d = 0; d < D; d += 16) {  // (perf: rounding the queries waited on them)
          prefetch_l2(ks + D + d);
          prefetch_l2(kz + D + d);
        }
      }
      if constexpr (INTQ) {
        round_queries(q, ks, kz, a.perm, RT, D, TARGET, iq);
      } else {
        for (int64_t r = 0; r < RT; ++r) {
          float bias = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            const float s = ks[a.perm[d]] / div;
            qs[r * D + d] = q[r * D + d] * s;
            bias += q[r * D + d] * (kz[a.perm[d]] - off * s);
          }
          kbias[r] = bias;
        }
      }
    }
    const int64_t row0 = bh * a.S + b0 - a.base;  // (the block's first row in the planes)
    // The planes of the block two ahead, asked for now: the kernel waited on these loads
    // (perf: half the task's time on the first touch of a block's bytes), as the few-row
    // linears did before they prefetched.
    if (b0 + 2 * block < stop) prefetch_block(a, row0 + 2 * block, block * half, TARGET);
    if constexpr (INTQ)  // every row's dots at once: the block's bytes are decoded once
      int_dots<DT, TARGET>(a.ku + row0 * half, a.kl + row0 * half, n, D, iq.codes.data(), RT,
                           dots.data());
    if constexpr (FAST) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = (row0 + j) * half;
        for (int64_t s = 0; s < D; s += 64) {
          const int64_t o = at + s / 2;
          if (!INTQ) A::template decode_segment<TARGET>(a.ku + o, a.kl + o, kbp + j * D + s);
          A::template decode_segment<TARGET>(a.vu + o, a.vl + o, vbp + j * D + s);
        }
      }
    } else {
      if (!INTQ) block_codes(a.ku + row0 * half, a.kl + row0 * half, n, D, TARGET, kbp);
      block_codes(a.vu + row0 * half, a.vl + row0 * half, n, D, TARGET, vbp);
    }
    const float* vs = a.vs + row0 * vgroups;
    const float* vz = a.vz + row0 * vgroups;
    const float *ws = nullptr, *wz = nullptr;
    if (vgroups == 1) {
      for (int64_t j = 0; j < n; ++j) vscale[j] = vs[j] / div, vzero[j] = vz[j] - off * vscale[j];
      ws = vscale, wz = vzero;
    } else {  // several V groups per token: dequantize the values in place
      for (int64_t j = 0; j < n; ++j) {
        float* __restrict vr = vbp + j * D;
        for (int64_t d = 0; d < D; ++d) {
          const int64_t grp = a.perm[d] / G;
          const float s = vs[j * vgroups + grp] / div;
          vr[d] = vr[d] * s + (vz[j * vgroups + grp] - off * s);
        }
      }
    }
    int live = 0;  // rows waiting in pw for their values' fold (the vector path)
    for (int64_t r = 0; r < RT; ++r) {
      if (!sees[r]) continue;
      float* p = pw[live];
      if constexpr (INTQ) {
        const float step = iq.step[r], bias = iq.bias[r];
        for (int64_t j = 0; j < n; ++j) p[j] = std::fma(float(dots[r * n + j]), step, bias);
      }
      if constexpr (FAST) {
        if (!INTQ) scores_vector<A, DT>(qs.data() + r * D, kbp, n, kbias[r], p);
        softcap_scores(p, n, a.softcap);
        for (int64_t j = 0; j < hide[r]; ++j) p[j] = NEG_INF;
        const float c = fold_weights<A>(p, n, ws, wz, rows.m[r], rows.l[r], zacc[r]);
        if (c < 0.f) continue;  // (every key hidden: the slot is reused)
        wrow[live] = p, arow[live] = rows.acc + r * D, corr[live] = c;
        if (++live == KR) {
          fold_values_rows<A, DT>(wrow, corr, live, n, vbp, arow);
          live = 0;
        }
      } else {
        if (!INTQ) scores_portable(qs.data() + r * D, kbp, n, D, kbias[r], p);
        softcap_scores(p, n, a.softcap);
        for (int64_t j = 0; j < hide[r]; ++j) p[j] = NEG_INF;
        fold_row_portable(p, n, vbp, ws, wz, D, rows.acc + r * D, rows.m[r], rows.l[r],
                          zacc[r]);
      }
    }
    if constexpr (FAST) {
      if (live) fold_values_rows<A, DT>(wrow, corr, live, n, vbp, arow);
    }
  }
  for (int64_t r = 0; r < RT; ++r) {  // the values' zeros, sum_j p_j z_j, reach every dim
    float* __restrict ar = rows.acc + r * D;
    for (int64_t d = 0; d < D; ++d) ar[d] += zacc[r];
  }
}

// One head's full-precision region (b, h of task bh) and a block of its keys and values,
// kb/vb [BLOCK, D] each, deinterleaved as the queries are (32-byte aligned).
struct Block {
  const float *fk, *fv;
  std::vector<float> buf;
  float *kb, *vb;
  Block(const Args& a, int64_t bh, int64_t D)
      : fk(a.fk + (bh / a.n_kv) * a.fk_b + (bh % a.n_kv) * a.fk_h),
        fv(a.fv + (bh / a.n_kv) * a.fv_b + (bh % a.n_kv) * a.fv_h),
        buf(2 * BLOCK * D + 8),
        kb(reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~31)),
        vb(kb + BLOCK * D) {}
};

// Region key `slot` into row j of the block.
template <int64_t DT, class A>
inline void load_key(const Args& a, Block& blk, int64_t slot, int64_t j) {
  constexpr bool FAST = DT != 0 && A::kVector;
  const int64_t D = DT ? DT : a.D;
  const float* kj = blk.fk + slot * a.fk_t;
  const float* vj = blk.fv + slot * a.fv_t;
  if constexpr (FAST) {
    for (int64_t s = 0; s < D; s += 64) {
      A::deinterleave_segment(kj + s, blk.kb + j * D + s);
      A::deinterleave_segment(vj + s, blk.vb + j * D + s);
    }
  } else {
    for (int64_t d = 0; d < D; ++d) {
      blk.kb[j * D + d] = kj[a.perm[d]];
      blk.vb[j * D + d] = vj[a.perm[d]];
    }
  }
}

// Row r folds block keys [lo, hi) of kb/vb into its online softmax (keys before lo masked).
// The row folds keys [0, hi) of the block, never the keys after its own position: how many
// of those there are depends on how many tokens came with it (a verify's later drafts), and
// folding them, even masked, would move where the vector body ends and the scalar tail
// begins (another exp, another summation order). `hi` is a function of the row's position
// (and a tree row's path) alone, so the row's bits are too.
template <int64_t DT, class A>
inline void fold_block_row(const Args& a, int64_t bh, int64_t r, Rows& rows, const float* kb,
                           const float* vb, int64_t lo, int64_t hi, float* p, float& zacc) {
  constexpr bool FAST = DT != 0 && A::kVector;
  const int64_t D = DT ? DT : a.D;
  const float* qr = a.q + (bh * rows.RT + r) * D;
  if constexpr (FAST)
    scores_vector<A, DT>(qr, kb, hi, 0.f, p);
  else
    scores_portable(qr, kb, hi, D, 0.f, p);
  softcap_scores(p, hi, a.softcap);
  for (int64_t j = 0; j < lo; ++j) p[j] = NEG_INF;
  if constexpr (FAST)
    fold_row_vector<A, DT>(p, hi, vb, nullptr, nullptr, rows.acc + r * D, rows.m[r], rows.l[r],
                           zacc);
  else
    fold_row_portable(p, hi, vb, nullptr, nullptr, D, rows.acc + r * D, rows.m[r], rows.l[r],
                      zacc);
}

// The full-precision region, with each query's mask, in blocks of BLOCK tokens.
template <int64_t DT, class A = simd::Attn>
void full_precision_task(const Args& a, int64_t bh, Rows& rows) {
  Block blk(a, bh, DT ? DT : a.D);
  alignas(32) float p[BLOCK];
  float zacc = 0.f;  // (no zeros here)
  for (int64_t b0 = 0; b0 < a.n_fp; b0 += BLOCK) {
    const int64_t n = std::min(BLOCK, a.n_fp - b0);
    for (int64_t j = 0; j < n; ++j) load_key<DT, A>(a, blk, b0 + j, j);
    for (int64_t r = 0; r < rows.RT; ++r) {
      const int64_t t = r % a.T;
      const int64_t lo = std::max({a.fp_lo[t] - b0, oldest(a, t) - a.fp_pos0 - b0, int64_t(0)});
      const int64_t hi = std::min<int64_t>(a.pos[t] - a.fp_pos0 - b0 + 1, n);  // keys [lo, hi)
      if (hi > lo) fold_block_row<DT, A>(a, bh, r, rows, blk.kb, blk.vb, lo, hi, p, zacc);
    }
  }
}

// The full-precision region of a token tree's verify. Row t folds the keys before the
// forward's rows (region [0, w)), then the rows of its path (root first): the very keys, in
// the very order and blocks, that the chain token at its position folds, so its bits are that
// token's, decoded alone or in a chain. The blocks' shared part is read once; each t patches
// in its path's keys (at most T of them) before its rows fold.
template <int64_t DT, class A = simd::Attn>
void tree_task(const Args& a, int64_t bh, Rows& rows) {
  const int64_t T = a.T;
  const int64_t w = a.pos[0] - a.fp_pos0;  // the forward's first row (a root) in the region
  Block blk(a, bh, DT ? DT : a.D);
  alignas(32) float p[BLOCK];
  float zacc = 0.f;
  int64_t keys = 0;  // the longest row's keys: w + its depth + 1
  for (int64_t t = 0; t < T; ++t) keys = std::max(keys, w + a.depth[t] + 1);
  for (int64_t b0 = 0; b0 < keys; b0 += BLOCK) {
    const int64_t shared = std::clamp<int64_t>(w - b0, 0, BLOCK);
    for (int64_t j = 0; j < shared; ++j) load_key<DT, A>(a, blk, b0 + j, j);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t hi = std::min<int64_t>(w + a.depth[t] + 1 - b0, BLOCK);  // keys [lo, hi)
      // (folded key i, a chain key or a path's, sits at position fp_pos0 + i: the window's
      // bound is the chain's)
      const int64_t lo = std::max({a.fp_lo[t] - b0, oldest(a, t) - a.fp_pos0 - b0, int64_t(0)});
      if (hi <= lo) continue;
      for (int64_t j = shared; j < hi; ++j)
        load_key<DT, A>(a, blk, w + a.paths[t * T + (b0 + j - w)], j);
      for (int64_t rr = 0; rr < a.R; ++rr)
        fold_block_row<DT, A>(a, bh, rr * T + t, rows, blk.kb, blk.vb, lo, hi, p, zacc);
    }
  }
}

template <int64_t DT>
void run_task(const Args& a, int64_t bh, int64_t c, Rows& rows) {
  if (c == a.n_chunks && a.paths) {
    tree_task<DT>(a, bh, rows);
  } else if (c == a.n_chunks) {
    full_precision_task<DT>(a, bh, rows);
  } else if (a.int_queries) {
    a.target ? quantized_task<DT, true, true>(a, bh, c, rows)
             : quantized_task<DT, false, true>(a, bh, c, rows);
  } else {
    a.target ? quantized_task<DT, true, false>(a, bh, c, rows)
             : quantized_task<DT, false, false>(a, bh, c, rows);
  }
}

at::Tensor as_long(const at::Tensor& x) {
  return x.scalar_type() == at::kLong && x.is_contiguous() ? x : x.to(at::kLong).contiguous();
}

at::Tensor dense(const at::Tensor& x) { return x.is_contiguous() ? x : x.contiguous(); }

}  // namespace

// The queries reordered, the views' pointers and the tasks' partials of one call.
struct HierAttention::State {
  at::Tensor k_upper, k_lower, v_upper, v_lower, k_scale, k_zero, v_scale, v_zero;
  at::Tensor n_quant_q, fp_lo, input_pos, fp_k, fp_v;  // (kept alive: Args points into them)
  std::vector<int64_t> perm, paths, depth;  // (a tree's: Args::paths, Args::depth)
  std::unique_ptr<float[]> qd, acc, ml;
  Args a;
  int64_t B, H, T, D, tasks, n_tasks;
};

// step.n_quant_q/shift/input_pos: integer [T]. layer.fp_k/fp_v: fp32, stride 1 along D.
HierAttention::HierAttention(const at::Tensor& q, const HierLayer& layer, const HierStep& step,
                             int64_t group_size, int64_t chunk, int64_t window,
                             int64_t base)
    : s_(std::make_unique<State>()) {
  TORCH_CHECK(window >= 0, "a sliding window is positive (0: none)");
  TORCH_CHECK(base >= 0 && base % group_size == 0 && (base == 0 || window > 0),
              "the planes begin at a multiple of G, past 0 only under a sliding window");
  State& s = *s_;
  s.fp_k = layer.fp_k, s.fp_v = layer.fp_v;
  const at::Tensor &fp_k = s.fp_k, &fp_v = s.fp_v;
  const int64_t fp_pos0 = step.n_quant;
  const bool target = step.int8, int_queries = step.int_queries;
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t n_kv = layer.k_upper.size(1), R = H / n_kv, RT = R * T;
  TORCH_CHECK(!int_queries || D <= kMaxIntQueryDim, "integer queries need head_dim <= ",
              kMaxIntQueryDim, ", not ", D);
  TORCH_CHECK(fp_k.scalar_type() == at::kFloat && fp_v.scalar_type() == at::kFloat,
              "fp_k/fp_v must be fp32");
  TORCH_CHECK(fp_k.stride(3) == 1 && fp_v.stride(3) == 1, "fp_k/fp_v need stride 1 along D");
  s.k_upper = dense(layer.k_upper), s.k_lower = dense(layer.k_lower);
  s.v_upper = dense(layer.v_upper), s.v_lower = dense(layer.v_lower);
  s.k_scale = dense(layer.k_scale), s.k_zero = dense(layer.k_zero);
  s.v_scale = dense(layer.v_scale), s.v_zero = dense(layer.v_zero);
  s.n_quant_q = as_long(step.n_quant_q), s.fp_lo = as_long(step.shift);
  s.input_pos = as_long(step.input_pos);
  auto q32 = q.scalar_type() == at::kFloat ? q : q.to(at::kFloat);

  s.perm.resize(D);
  for (int64_t d = 0; d < D; ++d) s.perm[d] = original_dim(d, D);
  // q [B, H, T, D] (any strides) -> [B, n_kv, R*T, D], scaled, deinterleaved
  s.qd.reset(new float[B * H * T * D]);
  {
    const float* qp = q32.data_ptr<float>();
    const int64_t sb = q32.stride(0), sh = q32.stride(1), st = q32.stride(2), sd = q32.stride(3);
    const float scale = float(1.0 / std::sqrt(double(D)));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t kv = h / R, r = (h % R) * T + t;
          float* o = s.qd.get() + ((b * n_kv + kv) * RT + r) * D;
          const float* in = qp + b * sb + h * sh + t * st;
          for (int64_t d = 0; d < D; ++d) o[d] = in[s.perm[d] * sd] * scale;
        }
  }
  Args& a = s.a;
  a.q = s.qd.get();
  a.ku = s.k_upper.data_ptr<uint8_t>();
  a.kl = s.k_lower.data_ptr<uint8_t>();
  a.vu = s.v_upper.data_ptr<uint8_t>();
  a.vl = s.v_lower.data_ptr<uint8_t>();
  a.ks = s.k_scale.data_ptr<float>();
  a.kz = s.k_zero.data_ptr<float>();
  a.vs = s.v_scale.data_ptr<float>();
  a.vz = s.v_zero.data_ptr<float>();
  a.fk = fp_k.data_ptr<float>();
  a.fv = fp_v.data_ptr<float>();
  a.fk_b = fp_k.stride(0), a.fk_h = fp_k.stride(1), a.fk_t = fp_k.stride(2);
  a.fv_b = fp_v.stride(0), a.fv_h = fp_v.stride(1), a.fv_t = fp_v.stride(2);
  a.nq = s.n_quant_q.data_ptr<int64_t>();
  a.fp_lo = s.fp_lo.data_ptr<int64_t>();
  a.pos = s.input_pos.data_ptr<int64_t>();
  a.paths = a.depth = nullptr;
  if (step.parents.defined()) {
    // each row's path from its root, checked: a parent is an earlier row or -1, row 0 a
    // root, a child one position after its parent, every path inside the region
    const auto parents = as_long(step.parents);
    TORCH_CHECK(parents.device().is_cpu() && parents.numel() == T,
                "parents: one entry per query row, on the CPU");
    TORCH_CHECK(T <= 64, "a token tree of at most 64 rows (a verify's)");
    TORCH_CHECK(a.pos[0] >= fp_pos0, "a tree's rows start in the full-precision region");
    const int64_t* par = parents.data_ptr<int64_t>();
    s.paths.assign(T * T, 0), s.depth.assign(T, 0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t up = par[t];
      TORCH_CHECK(up >= -1 && up < t && (t > 0 || up == -1),
                  "parents[t] must be an earlier row or -1 (row 0: -1)");
      TORCH_CHECK(a.pos[t] == (up < 0 ? a.pos[0] : a.pos[up] + 1),
                  "a tree row's position is its parent's + 1 (a root's: the first row's)");
      s.depth[t] = up < 0 ? 0 : s.depth[up] + 1;
      if (up >= 0) std::copy_n(&s.paths[up * T], s.depth[up] + 1, &s.paths[t * T]);
      s.paths[t * T + s.depth[t]] = t;
    }
    TORCH_CHECK(a.pos[0] - fp_pos0 + T <= fp_k.size(2), "a tree's rows lie in the region");
    a.paths = s.paths.data(), a.depth = s.depth.data();
  }
  a.perm = s.perm.data();
  a.B = B, a.n_kv = n_kv, a.R = R, a.T = T, a.D = D, a.S = s.k_upper.size(2);
  a.G = group_size, a.n_fp = fp_k.size(2), a.fp_pos0 = fp_pos0;
  a.chunk = chunk, a.target = target, a.int_queries = int_queries, a.softcap = step.softcap;
  a.window = window;
  a.base = base;
  a.max_nq = *std::max_element(a.nq, a.nq + T);
  // every key a query can see must be held: none below the planes' first position, none past
  // their end
  for (int64_t t = 0; t < T && base; ++t)
    TORCH_CHECK(a.nq[t] <= oldest(a, t) || oldest(a, t) >= base, "a query at ", a.pos[t],
                " sees positions below ", base, ", which this layer no longer holds");
  TORCH_CHECK(a.max_nq <= base + a.S, "the history (", a.max_nq, ") is past the planes' end (",
              base + a.S, ")");
  a.n_chunks = (a.max_nq + chunk - 1) / chunk;
  s.B = B, s.H = H, s.T = T, s.D = D;
  s.tasks = a.n_chunks + 1;  // + the full-precision region
  s.n_tasks = B * n_kv * s.tasks;
  s.acc.reset(new float[s.n_tasks * RT * D]);
  s.ml.reset(new float[s.n_tasks * 2 * RT]);
}

HierAttention::HierAttention(HierAttention&&) noexcept = default;
HierAttention& HierAttention::operator=(HierAttention&&) noexcept = default;
HierAttention::~HierAttention() = default;

int64_t HierAttention::tasks() const { return s_->n_tasks; }

void HierAttention::run(int64_t begin, int64_t end) const {
  const State& s = *s_;
  const Args& a = s.a;
  const int64_t RT = a.R * a.T, D = a.D;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t bh = i / s.tasks, c = i % s.tasks;
    Rows rows{RT, D, s.acc.get() + i * RT * D, s.ml.get() + i * 2 * RT,
              s.ml.get() + i * 2 * RT + RT};
    std::fill(rows.acc, rows.acc + RT * D, 0.f);
    std::fill(rows.m, rows.m + RT, NEG_INF);
    std::fill(rows.l, rows.l + RT, 0.f);
    if (simd::Attn::kVector && D == 64)
      run_task<64>(a, bh, c, rows);
    else if (simd::Attn::kVector && D == 128)
      run_task<128>(a, bh, c, rows);
    else
      run_task<0>(a, bh, c, rows);
  }
}

// log-sum-exp merge over tasks, written to out_p [B, T, H, D] with dims re-interleaved
void HierAttention::finish_into(float* out_p) const {
  const State& s = *s_;
  const int64_t H = s.H, T = s.T, D = s.D, n_kv = s.a.n_kv, R = s.a.R, RT = R * T;
  const int64_t B = s.B, tasks = s.tasks;
  const float *acc_p = s.acc.get(), *ml_p = s.ml.get();
  std::vector<float> o(D);
  for (int64_t bh = 0; bh < B * n_kv; ++bh) {
    const int64_t b = bh / n_kv, kv = bh % n_kv;
    for (int64_t r = 0; r < RT; ++r) {
      const int64_t t = r % T, h = kv * R + r / T;
      float* dst = out_p + ((b * T + t) * H + h) * D;
      float mx = NEG_INF;
      for (int64_t c = 0; c < tasks; ++c) mx = std::max(mx, ml_p[(bh * tasks + c) * 2 * RT + r]);
      std::fill(o.begin(), o.end(), 0.f);
      if (mx != NEG_INF) {
        float denom = 0.f;
        for (int64_t c = 0; c < tasks; ++c) {
          const float mc = ml_p[(bh * tasks + c) * 2 * RT + r];
          if (mc == NEG_INF) continue;
          const float w = std::exp(mc - mx);
          denom += w * ml_p[(bh * tasks + c) * 2 * RT + RT + r];
          const float* ac = acc_p + ((bh * tasks + c) * RT + r) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * ac[d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= denom;
      }
      for (int64_t d = 0; d < D; ++d) dst[s.perm[d]] = o[d];
    }
  }
}

at::Tensor HierAttention::finish() const {
  auto out = at::empty({s_->B, s_->T, s_->H, s_->D}, at::kFloat);
  finish_into(out.data_ptr<float>());
  return out.permute({0, 2, 1, 3});
}

at::Tensor run_on_pool(const HierAttention& attention) {
  at::parallel_for(0, attention.tasks(), 1,
                   [&](int64_t begin, int64_t end) { attention.run(begin, end); });
  return attention.finish();
}

// Returns [B, H, T, D] fp32 (a view of a [B, T, H, D] buffer, so that the caller's
// transpose(1, 2).reshape(B, T, H * D) for the output projection is free).
at::Tensor hier_attention_cpu(const at::Tensor& q, const HierLayer& layer, const HierStep& step,
                              int64_t group_size, int64_t chunk, int64_t window,
                              int64_t base) {
  return run_on_pool(HierAttention(q, layer, step, group_size, chunk, window, base));
}
