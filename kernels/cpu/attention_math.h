// The float side of the CPU attention over the hierarchical cache (hier_attention.cpp): the
// online-softmax fold of a block of scored keys into a row's (acc, max, sum), fp32 scores, and
// the decoders of the nibble planes and of the full-precision rows into the kernel's
// "deinterleaved" order (see hier_attention.cpp). Portable C++, and a vector path on the SIMD
// layer's attention ops (simd.h: simd::Attn); included by hier_attention.cpp alone.
#pragma once
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace attn {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Dims per deinterleaved segment: 64, or the whole head when 64 does not divide it.
inline int64_t segment_width(int64_t D) { return D % 64 == 0 ? 64 : D; }

// ------------------------------------------------------------------------------ portable path

// Nibble rows -> codes in deinterleaved order: U (draft) or 16 U + L with L = lower - 8
// (target), as floats. out [n, D].
inline void block_codes(const uint8_t* __restrict up, const uint8_t* __restrict lo, int64_t n,
                        int64_t D, bool target, float* __restrict out) {
  const int64_t W = segment_width(D), hw = W / 2, half = D / 2;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t s = 0; s < D; s += W) {
      const uint8_t* u = up + j * half + s / 2;
      const uint8_t* w = lo + j * half + s / 2;
      float* o = out + j * D + s;
      if (!target) {
        for (int64_t i = 0; i < hw; ++i) o[i] = float(u[i] & 15);
        for (int64_t i = 0; i < hw; ++i) o[hw + i] = float(u[i] >> 4);
      } else {
        for (int64_t i = 0; i < hw; ++i) o[i] = float(16 * (u[i] & 15) + (w[i] & 15) - 8);
        for (int64_t i = 0; i < hw; ++i) o[hw + i] = float(16 * (u[i] >> 4) + (w[i] >> 4) - 8);
      }
    }
  }
}

// Fold scored keys into row r: p [n] holds scores (-inf for hidden keys) and is overwritten;
// values vb [n, D]; `vscale`/`vzero` (per token, or null when vb holds values) turn codes into
// values: sum_j p_j (s_j c_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j (the latter in zacc);
// vscale holds s_j already divided by the view's step divisor.
inline void fold_row_portable(float* __restrict p, int64_t n, const float* __restrict vb,
                              const float* vscale, const float* vzero, int64_t D,
                              float* __restrict acc, float& m, float& l, float& zacc) {
  float mx = m;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == NEG_INF) return;
  const float corr = std::exp(m - mx);  // 0 while m was -inf
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = std::exp(p[j] - mx);
    sum += p[j];
  }
  float z = zacc * corr;
  if (vscale != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      z += p[j] * vzero[j];
      p[j] *= vscale[j];
    }
  }
  zacc = z;
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* __restrict vj = vb + j * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += pj * vj[d];
  }
  l = l * corr + sum;
  m = mx;
}

inline void scores_portable(const float* __restrict qr, const float* __restrict kb, int64_t n,
                            int64_t D, float bias, float* __restrict p) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict kj = kb + j * D;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
    p[j] = dot + bias;
  }
}

// Logit soft-capping (Gemma 2's attn_logit_softcapping): p [n] scaled scores -> cap * tanh(p /
// cap), in place; cap 0: none. Before any key is hidden (-inf would become -cap). Scalar tanhf:
// a row's bits do not depend on n's split into vectors and tail.
inline void softcap_scores(float* __restrict p, int64_t n, float cap) {
  if (cap == 0.f) return;
  for (int64_t j = 0; j < n; ++j) p[j] = cap * std::tanh(p[j] / cap);
}

// ------------------------------------------------------------------------------ vector path
// On the SIMD layer's attention ops (simd::Attn, A here: x86 builds; A::kVector false
// elsewhere), head_dim D a multiple of 64.

// Scores of one row against n keys kb [n, D]: p[j] = qr . k_j + bias. Eight keys at a time,
// eight independent FMA chains, one transposed reduction.
template <class A, int64_t D>
inline void scores_vector(const float* __restrict qr, const float* __restrict kb, int64_t n,
                          float bias, float* __restrict p) {
  using S = typename A::Scores;
  constexpr int64_t NV = D / S::kLanes;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    typename S::V acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = S::set(0.f);
    const float* k = kb + j * D;
    for (int64_t v = 0; v < NV; ++v) {
      const auto qv = S::load(qr + S::kLanes * v);
      for (int t = 0; t < 8; ++t) acc[t] = S::fma(qv, S::load(k + t * D + S::kLanes * v), acc[t]);
    }
    S::store(p + j, S::add(S::sums8(acc), S::set(bias)));
  }
  for (; j < n; ++j) {
    auto acc = S::set(0.f);
    for (int64_t v = 0; v < NV; ++v)
      acc = S::fma(S::load(qr + S::kLanes * v), S::load(kb + j * D + S::kLanes * v), acc);
    p[j] = S::sum(acc) + bias;
  }
}

// The softmax half of fold_row_portable in A's fold lanes (n <= BLOCK): p [n] scores ->
// weights (times the values' scales where given); updates (m, l, zacc) and returns the factor
// the row's acc must be multiplied by first, or -1 when every key is hidden (nothing changes).
// Whole vectors of keys, the tail scalar.
template <class A>
inline float fold_weights(float* __restrict p, int64_t n, const float* vscale,
                          const float* vzero, float& m, float& l, float& zacc) {
  using F = typename A::Fold;
  using V = typename F::V;
  constexpr int64_t L = F::kLanes;
  const int64_t nv = n & ~int64_t(L - 1);  // whole vectors; the tail goes scalar
  V vm = F::set(m);
  for (int64_t j = 0; j < nv; j += L) vm = F::max(vm, F::load(p + j));
  float mx = F::max_of(vm);
  for (int64_t j = nv; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == NEG_INF) return -1.f;
  const float corr = std::exp(m - mx);  // 0 while m was -inf
  const V vmx = F::set(mx);
  V vsum = F::set(0.f), vz = F::set(0.f);
  for (int64_t j = 0; j < nv; j += L) {
    V e = F::exp(F::sub(F::load(p + j), vmx));
    vsum = F::add(vsum, e);
    if (vscale != nullptr) {  // per-token value scales (already / div) and zeros
      vz = F::fma(e, F::load(vzero + j), vz);
      e = F::mul(e, F::load(vscale + j));
    }
    F::store(p + j, e);
  }
  float sum = F::sum(vsum), z = zacc * corr + F::sum(vz);
  for (int64_t j = nv; j < n; ++j) {
    float e = std::exp(p[j] - mx);
    sum += e;
    if (vscale != nullptr) {
      z += e * vzero[j];
      e *= vscale[j];
    }
    p[j] = e;
  }
  zacc = z;
  l = l * corr + sum;
  m = mx;
  return corr;
}

// The values' half for K rows at once: acc_k = acc_k * corr_k + sum_j w_k[j] vb[j] over the
// same n tokens vb [n, D], 64 dims at a time. Each accumulator sees the same operations in the
// same order as with K = 1 (a row's bits do not depend on its companions); the K rows share
// each loaded value vector, and their K * 64 / L independent FMA chains hide the FMA latency
// that one row's 64 / L chains (4 with 16 lanes) wait on.
template <class A, int64_t D, int K>
inline void fold_values(const float* const* w, const float* corr, int64_t n,
                        const float* __restrict vb, float* const* acc) {
  using F = typename A::Fold;
  using V = typename F::V;
  constexpr int64_t L = F::kLanes, NV = D / L, R = 64 / L;  // R vectors: 64 dims
  for (int64_t h = 0; h < NV; h += R) {  // the accumulators stay in registers
    V r[K][R];
    for (int k = 0; k < K; ++k)
      for (int i = 0; i < R; ++i) r[k][i] = F::mul(F::load(acc[k] + L * (h + i)), F::set(corr[k]));
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = vb + j * D + L * h;
      if constexpr (K == 1) {
        const V wk = F::set(w[0][j]);
        for (int i = 0; i < R; ++i) r[0][i] = F::fma(wk, F::load(vj + L * i), r[0][i]);
      } else {
        V v[R];
        for (int i = 0; i < R; ++i) v[i] = F::load(vj + L * i);
        for (int k = 0; k < K; ++k) {
          const V wk = F::set(w[k][j]);
          for (int i = 0; i < R; ++i) r[k][i] = F::fma(wk, v[i], r[k][i]);
        }
      }
    }
    for (int k = 0; k < K; ++k)
      for (int i = 0; i < R; ++i) F::store(acc[k] + L * (h + i), r[k][i]);
  }
}

// fold_row_portable in A's fold lanes (n <= BLOCK): one row's weights, then its values.
template <class A, int64_t D>
inline void fold_row_vector(float* __restrict p, int64_t n, const float* __restrict vb,
                            const float* vscale, const float* vzero, float* __restrict acc,
                            float& m, float& l, float& zacc) {
  const float corr = fold_weights<A>(p, n, vscale, vzero, m, l, zacc);
  if (corr < 0.f) return;
  const float* w[1] = {p};
  float* out[1] = {acc};
  fold_values<A, D, 1>(w, &corr, n, vb, out);
}

// Rows whose values' fold shares one pass: A::kFoldRows where A has the vector path, else 1.
template <class A>
constexpr int fold_rows() {
  if constexpr (A::kVector)
    return A::kFoldRows;
  else
    return 1;
}

// fold_values over any number of rows, A::kFoldRows (the registers' worth) at a time.
template <class A, int64_t D>
inline void fold_values_rows(const float* const* w, const float* corr, int64_t rows, int64_t n,
                             const float* __restrict vb, float* const* acc) {
  constexpr int KR = A::kFoldRows;
  static_assert(KR >= 1 && KR <= 6, "fold_values_rows instantiates 1..6 rows");
  for (int64_t k0 = 0; k0 < rows; k0 += KR) {
    const int64_t k = std::min<int64_t>(KR, rows - k0);
    const float* const* wk = w + k0;
    float* const* ak = acc + k0;
    switch (k) {
      case 1: fold_values<A, D, 1>(wk, corr + k0, n, vb, ak); break;
      case 2: if constexpr (KR >= 2) fold_values<A, D, 2>(wk, corr + k0, n, vb, ak); break;
      case 3: if constexpr (KR >= 3) fold_values<A, D, 3>(wk, corr + k0, n, vb, ak); break;
      case 4: if constexpr (KR >= 4) fold_values<A, D, 4>(wk, corr + k0, n, vb, ak); break;
      case 5: if constexpr (KR >= 5) fold_values<A, D, 5>(wk, corr + k0, n, vb, ak); break;
      default: if constexpr (KR >= 6) fold_values<A, D, 6>(wk, corr + k0, n, vb, ak); break;
    }
  }
}

}  // namespace attn

