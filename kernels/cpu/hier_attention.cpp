// Flash-decoding over the hierarchical INT4/INT8 KV cache, for CPUs.
//
// The twin of kernels/triton/hier_attention.py (Triton) with the same arguments, for the CPU
// that has no Triton: the packed nibble planes are decoded a block of tokens at a time into a
// small float buffer in L1 and consumed at once, so no full-precision copy of the history is
// ever built. Work splits into (batch x KV head x chunk of history) tasks over torch's thread
// pool, each leaving softmax partials (acc, max, sum) that a final pass merges by log-sum-exp;
// the full-precision region is one more task per head.
//
// Two implementations of a task: AVX2/FMA intrinsics for head_dim 64 and 128 (the models
// qspec runs), and portable C++ for the rest and for CPUs without AVX2. Both fold each row's
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
#include <torch/extension.h>

#include "kernels.h"  // (the declarations these definitions must match)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QSPEC_AVX2 1
#endif

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t BLOCK = 32;  // tokens decoded together (fewer when G < 32)

struct Args {
  const float* q;  // [B * n_kv, R * T, D] scaled by 1/sqrt(D), deinterleaved
  const uint8_t *ku, *kl, *vu, *vl;
  const float *ks, *kz, *vs, *vz;
  const float *fk, *fv;
  int64_t fk_b, fk_h, fk_t, fv_b, fv_h, fv_t;  // fp region strides (elements)
  const int64_t *nq, *fp_lo, *pos;
  const int64_t* perm;  // [D] deinterleaved position -> original dim
  int64_t B, n_kv, R, T, D, S, G, n_fp, fp_pos0, chunk, n_chunks, max_nq;
  bool target;
};

// Online-softmax state of the R*T query rows of one KV head over one task's keys.
struct Rows {
  int64_t RT, D;
  float* __restrict acc;  // [RT, D]
  float* __restrict m;    // [RT]
  float* __restrict l;    // [RT]
};

inline int64_t segment_width(int64_t D) { return D % 64 == 0 ? 64 : D; }

// Deinterleaved position p -> the original dim it holds.
inline int64_t original_dim(int64_t p, int64_t D) {
  const int64_t W = segment_width(D), hw = W / 2, s = p / W, w = p % W;
  return s * W + (w < hw ? 2 * w : 2 * (w - hw) + 1);
}

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
void fold_row_portable(float* __restrict p, int64_t n, const float* __restrict vb,
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

void scores_portable(const float* __restrict qr, const float* __restrict kb, int64_t n,
                     int64_t D, float bias, float* __restrict p) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict kj = kb + j * D;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
    p[j] = dot + bias;
  }
}

// ------------------------------------------------------------------------------ AVX2 path
#ifdef QSPEC_AVX2

// exp(x) for the softmax (x <= 0), Cephes' polynomial: a few ulp; exp(-inf) = 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Eight vectors -> the vector of their eight horizontal sums, in order.
inline __m256 hsum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 32 bytes 0..255 -> 32 floats.
inline void bytes_to_floats(__m256i x, float* out) {
  const __m128i lo = _mm256_castsi256_si128(x), hi = _mm256_extracti128_si256(x, 1);
  _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
  _mm256_store_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
  _mm256_store_ps(out + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
  _mm256_store_ps(out + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
}

// One 64-dim segment of a token (32 bytes per plane) -> 64 codes, deinterleaved: U (draft)
// or 16 U + lower (target; the lower plane's +8 is folded into the zeros by the caller).
template <bool TARGET>
inline void decode_segment(const uint8_t* up, const uint8_t* lo, float* out) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(up));
  __m256i even, odd;
  if (!TARGET) {
    even = _mm256_and_si256(u, m);
    odd = _mm256_and_si256(_mm256_srli_epi16(u, 4), m);
  } else {
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
    even = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, m), 4), _mm256_and_si256(l, m));
    odd = _mm256_or_si256(_mm256_andnot_si256(m, u),
                          _mm256_and_si256(_mm256_srli_epi16(l, 4), m));
  }
  bytes_to_floats(even, out);
  bytes_to_floats(odd, out + 32);
}

// 64 fp32 dims in original order -> deinterleaved (even dims, then odd).
inline void deinterleave_segment(const float* in, float* out) {
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_loadu_ps(in + 16 * i), b = _mm256_loadu_ps(in + 16 * i + 8);
    const __m256 ev = _mm256_shuffle_ps(a, b, 0x88), od = _mm256_shuffle_ps(a, b, 0xDD);
    _mm256_store_ps(out + 8 * i,
                    _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
    _mm256_store_ps(out + 32 + 8 * i,
                    _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
  }
}

// Scores of one row against n keys kb [n, D]: p[j] = qr . k_j + bias. Eight keys at a time,
// eight independent FMA chains, one transposed reduction.
template <int64_t D>
inline void scores_avx2(const float* __restrict qr, const float* __restrict kb, int64_t n,
                        float bias, float* __restrict p) {
  constexpr int64_t NV = D / 8;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    const float* k = kb + j * D;
    for (int64_t v = 0; v < NV; ++v) {
      const __m256 qv = _mm256_loadu_ps(qr + 8 * v);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_load_ps(k + t * D + 8 * v), acc[t]);
    }
    _mm256_storeu_ps(p + j, _mm256_add_ps(hsum8(acc), _mm256_set1_ps(bias)));
  }
  for (; j < n; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t v = 0; v < NV; ++v)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * v), _mm256_load_ps(kb + j * D + 8 * v), acc);
    p[j] = hsum(acc) + bias;
  }
}

// fold_row_portable with intrinsics (n <= BLOCK).
template <int64_t D>
inline void fold_row_avx2(float* __restrict p, int64_t n, const float* __restrict vb,
                          const float* vscale, const float* vzero, float* __restrict acc, float& m, float& l, float& zacc) {
  constexpr int64_t NV = D / 8;
  const int64_t n8 = n & ~int64_t(7);  // whole vectors; the tail goes scalar
  __m256 vm = _mm256_set1_ps(m);
  for (int64_t j = 0; j < n8; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(p + j));
  __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
  float mx = std::max(_mm_cvtss_f32(h4), _mm_cvtss_f32(_mm_movehdup_ps(h4)));
  for (int64_t j = n8; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == NEG_INF) return;
  const float corr = std::exp(m - mx);  // 0 while m was -inf
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps(), vz = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmx));
    vsum = _mm256_add_ps(vsum, e);
    if (vscale != nullptr) {  // per-token value scales (already / div) and zeros
      vz = _mm256_fmadd_ps(e, _mm256_loadu_ps(vzero + j), vz);
      e = _mm256_mul_ps(e, _mm256_loadu_ps(vscale + j));
    }
    _mm256_storeu_ps(p + j, e);
  }
  float sum = hsum(vsum), z = zacc * corr + hsum(vz);
  for (int64_t j = n8; j < n; ++j) {
    float e = std::exp(p[j] - mx);
    sum += e;
    if (vscale != nullptr) {
      z += e * vzero[j];
      e *= vscale[j];
    }
    p[j] = e;
  }
  zacc = z;
  int64_t j;
  const __m256 vc = _mm256_set1_ps(corr);
  for (int64_t h = 0; h < NV; h += 8) {  // 64 dims at a time: the accumulators stay in registers
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (h + i)), vc);
    for (j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      const float* vj = vb + j * D + 8 * h;
      for (int i = 0; i < 8; ++i) r[i] = _mm256_fmadd_ps(w, _mm256_load_ps(vj + 8 * i), r[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * (h + i), r[i]);
  }
  l = l * corr + sum;
  m = mx;
}
#endif  // QSPEC_AVX2

// ------------------------------------------------------------------------------ tasks

// The quantized history, with the dequantization folded into the math instead of the data:
//   K (per channel): q . k_j = sum_d (q_d s_d) c_jd + sum_d q_d z_d, so q is scaled once per
//     K group and the dot runs on the raw codes c;
//   V (per token, one group): sum_j p_j (s_j c_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j.
// Codes are U (draft) or 16 U + L (target, with s / 16 as the step). The AVX2 decoder gives
// the target 16 U + (L + 8), so its zeros absorb -8 steps (`off`).
// DT: head_dim known at compile time (64, 128: the AVX2 path), 0 for the portable one.
template <int64_t DT, bool TARGET>
void quantized_task(const Args& a, int64_t bh, int64_t c, Rows& rows) {
  constexpr bool FAST = DT != 0;
  const int64_t D = DT ? DT : a.D, half = D / 2, G = a.G, RT = rows.RT;
  const int64_t start = c * a.chunk, stop = std::min(start + a.chunk, a.max_nq);
  const float div = TARGET ? 16.f : 1.f;
  const float off = FAST && TARGET ? 8.f : 0.f;  // codes the decoder leaves + 8 too high
  const int64_t vgroups = D / G;
  const int64_t block = std::min(BLOCK, G);  // a block must not straddle two K groups
  alignas(32) float kb[BLOCK * 128], vb[BLOCK * 128];
  std::vector<float> big;  // portable path, head_dim > 128
  float *kbp = kb, *vbp = vb;
  if (D > 128) {
    big.resize(2 * BLOCK * D);
    kbp = big.data(), vbp = big.data() + BLOCK * D;
  }
  alignas(32) float p[BLOCK], vscale[BLOCK], vzero[BLOCK];
  std::vector<float> qs(RT * D), kbias(RT), zacc(RT, 0.f);
  std::vector<char> sees(RT);
  const float* q = a.q + bh * RT * D;
  int64_t group = -1;
  for (int64_t b0 = start; b0 < stop; b0 += block) {
    const int64_t n = std::min(block, stop - b0);
    bool any = false;
    for (int64_t r = 0; r < RT; ++r) {  // history is all-or-nothing per G-aligned block
      sees[r] = b0 < a.nq[r % a.T];
      any |= sees[r];
    }
    if (!any) continue;
    const int64_t g = b0 / G;  // a block lies within one K group
    if (g != group) {
      group = g;
      const float* ks = a.ks + (bh * (a.S / G) + g) * D;
      const float* kz = a.kz + (bh * (a.S / G) + g) * D;
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
    const int64_t row0 = bh * a.S + b0;
#ifdef QSPEC_AVX2
    if constexpr (FAST) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = (row0 + j) * half;
        for (int64_t s = 0; s < D; s += 64) {
          decode_segment<TARGET>(a.ku + at + s / 2, a.kl + at + s / 2, kbp + j * D + s);
          decode_segment<TARGET>(a.vu + at + s / 2, a.vl + at + s / 2, vbp + j * D + s);
        }
      }
    }
#endif
    if constexpr (!FAST) {
      block_codes(a.ku + row0 * half, a.kl + row0 * half, n, D, TARGET, kbp);
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
    for (int64_t r = 0; r < RT; ++r) {
      if (!sees[r]) continue;
#ifdef QSPEC_AVX2
      if constexpr (FAST) {
        scores_avx2<DT>(qs.data() + r * D, kbp, n, kbias[r], p);
        fold_row_avx2<DT>(p, n, vbp, ws, wz, rows.acc + r * D, rows.m[r], rows.l[r],
                          zacc[r]);
        continue;
      }
#endif
      scores_portable(qs.data() + r * D, kbp, n, D, kbias[r], p);
      fold_row_portable(p, n, vbp, ws, wz, D, rows.acc + r * D, rows.m[r], rows.l[r],
                        zacc[r]);
    }
  }
  for (int64_t r = 0; r < RT; ++r) {  // the values' zeros, sum_j p_j z_j, reach every dim
    float* __restrict ar = rows.acc + r * D;
    for (int64_t d = 0; d < D; ++d) ar[d] += zacc[r];
  }
}

// The full-precision region, with each query's mask, in blocks of BLOCK tokens.
template <int64_t DT>
void full_precision_task(const Args& a, int64_t bh, Rows& rows) {
  const int64_t D = DT ? DT : a.D, RT = rows.RT;
  const int64_t b = bh / a.n_kv, h = bh % a.n_kv;
  const float* fk = a.fk + b * a.fk_b + h * a.fk_h;
  const float* fv = a.fv + b * a.fv_b + h * a.fv_h;
  std::vector<float> buf(2 * BLOCK * D + 8);
  float* kb = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~31);
  float* vb = kb + BLOCK * D;
  alignas(32) float p[BLOCK];
  float zacc = 0.f;  // (no zeros here)
  for (int64_t b0 = 0; b0 < a.n_fp; b0 += BLOCK) {
    const int64_t n = std::min(BLOCK, a.n_fp - b0);
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = fk + (b0 + j) * a.fk_t;
      const float* vj = fv + (b0 + j) * a.fv_t;
#ifdef QSPEC_AVX2
      if constexpr (DT != 0) {
        for (int64_t s = 0; s < D; s += 64) {
          deinterleave_segment(kj + s, kb + j * D + s);
          deinterleave_segment(vj + s, vb + j * D + s);
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) {
        kb[j * D + d] = kj[a.perm[d]];
        vb[j * D + d] = vj[a.perm[d]];
      }
    }
    for (int64_t r = 0; r < RT; ++r) {
      const int64_t t = r % a.T;
      const int64_t lo = std::max<int64_t>(a.fp_lo[t] - b0, 0);
      const int64_t hi = std::min<int64_t>(a.pos[t] - a.fp_pos0 - b0 + 1, n);  // keys [lo, hi)
      if (hi <= lo) continue;
      // The row folds keys [0, hi) of the block, never the keys after its own position:
      // how many of those there are depends on how many tokens came with it (a verify's
      // later drafts), and folding them, even masked, would move where the vector body ends
      // and the scalar tail begins (another exp, another summation order). `hi` is a
      // function of the row's position alone, so the row's bits are too.
      const float* qr = a.q + (bh * RT + r) * D;
#ifdef QSPEC_AVX2
      if constexpr (DT != 0) {
        scores_avx2<DT>(qr, kb, hi, 0.f, p);
      }
#endif
      if constexpr (DT == 0) scores_portable(qr, kb, hi, D, 0.f, p);
      for (int64_t j = 0; j < lo; ++j) p[j] = NEG_INF;
#ifdef QSPEC_AVX2
      if constexpr (DT != 0) {
        fold_row_avx2<DT>(p, hi, vb, nullptr, nullptr, rows.acc + r * D, rows.m[r],
                          rows.l[r], zacc);
        continue;
      }
#endif
      fold_row_portable(p, hi, vb, nullptr, nullptr, D, rows.acc + r * D, rows.m[r],
                        rows.l[r], zacc);
    }
  }
}

template <int64_t DT>
void run_task(const Args& a, int64_t bh, int64_t c, Rows& rows) {
  if (c == a.n_chunks) {
    full_precision_task<DT>(a, bh, rows);
  } else if (a.target) {
    quantized_task<DT, true>(a, bh, c, rows);
  } else {
    quantized_task<DT, false>(a, bh, c, rows);
  }
}

torch::Tensor as_long(const torch::Tensor& x) {
  return x.scalar_type() == torch::kLong && x.is_contiguous() ? x : x.to(torch::kLong).contiguous();
}

torch::Tensor dense(const torch::Tensor& x) { return x.is_contiguous() ? x : x.contiguous(); }

}  // namespace

// Returns [B, H, T, D] fp32 (a view of a [B, T, H, D] buffer, so that the caller's
// transpose(1, 2).reshape(B, T, H * D) for the output projection is free).
// n_quant_q/fp_lo/input_pos: integer [T]. fp_k/fp_v: fp32, stride 1 along D.
torch::Tensor hier_attention_cpu(torch::Tensor q, torch::Tensor k_upper, torch::Tensor k_lower,
                                 torch::Tensor k_scale, torch::Tensor k_zero,
                                 torch::Tensor v_upper, torch::Tensor v_lower,
                                 torch::Tensor v_scale, torch::Tensor v_zero,
                                 torch::Tensor n_quant_q, torch::Tensor fp_k, torch::Tensor fp_v,
                                 int64_t fp_pos0, torch::Tensor fp_lo, torch::Tensor input_pos,
                                 bool target, int64_t group_size, int64_t chunk) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t n_kv = k_upper.size(1), R = H / n_kv, RT = R * T;
  TORCH_CHECK(fp_k.scalar_type() == torch::kFloat && fp_v.scalar_type() == torch::kFloat,
              "fp_k/fp_v must be fp32");
  TORCH_CHECK(fp_k.stride(3) == 1 && fp_v.stride(3) == 1, "fp_k/fp_v need stride 1 along D");
  k_upper = dense(k_upper), k_lower = dense(k_lower), v_upper = dense(v_upper);
  v_lower = dense(v_lower), k_scale = dense(k_scale), k_zero = dense(k_zero);
  v_scale = dense(v_scale), v_zero = dense(v_zero);
  n_quant_q = as_long(n_quant_q), fp_lo = as_long(fp_lo), input_pos = as_long(input_pos);
  auto q32 = q.scalar_type() == torch::kFloat ? q : q.to(torch::kFloat);

  std::vector<int64_t> perm(D);
  for (int64_t d = 0; d < D; ++d) perm[d] = original_dim(d, D);
  // q [B, H, T, D] (any strides) -> [B, n_kv, R*T, D], scaled, deinterleaved
  std::unique_ptr<float[]> qd(new float[B * H * T * D]);
  {
    const float* qp = q32.data_ptr<float>();
    const int64_t sb = q32.stride(0), sh = q32.stride(1), st = q32.stride(2), sd = q32.stride(3);
    const float scale = float(1.0 / std::sqrt(double(D)));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t kv = h / R, r = (h % R) * T + t;
          float* o = qd.get() + ((b * n_kv + kv) * RT + r) * D;
          const float* in = qp + b * sb + h * sh + t * st;
          for (int64_t d = 0; d < D; ++d) o[d] = in[perm[d] * sd] * scale;
        }
  }
  Args a;
  a.q = qd.get();
  a.ku = k_upper.data_ptr<uint8_t>();
  a.kl = k_lower.data_ptr<uint8_t>();
  a.vu = v_upper.data_ptr<uint8_t>();
  a.vl = v_lower.data_ptr<uint8_t>();
  a.ks = k_scale.data_ptr<float>();
  a.kz = k_zero.data_ptr<float>();
  a.vs = v_scale.data_ptr<float>();
  a.vz = v_zero.data_ptr<float>();
  a.fk = fp_k.data_ptr<float>();
  a.fv = fp_v.data_ptr<float>();
  a.fk_b = fp_k.stride(0), a.fk_h = fp_k.stride(1), a.fk_t = fp_k.stride(2);
  a.fv_b = fp_v.stride(0), a.fv_h = fp_v.stride(1), a.fv_t = fp_v.stride(2);
  a.nq = n_quant_q.data_ptr<int64_t>();
  a.fp_lo = fp_lo.data_ptr<int64_t>();
  a.pos = input_pos.data_ptr<int64_t>();
  a.perm = perm.data();
  a.B = B, a.n_kv = n_kv, a.R = R, a.T = T, a.D = D, a.S = k_upper.size(2);
  a.G = group_size, a.n_fp = fp_k.size(2), a.fp_pos0 = fp_pos0;
  a.chunk = chunk, a.target = target;
  a.max_nq = *std::max_element(a.nq, a.nq + T);
  a.n_chunks = (a.max_nq + chunk - 1) / chunk;
  const int64_t tasks = a.n_chunks + 1;  // + the full-precision region
  const int64_t n_tasks = B * n_kv * tasks;
  std::unique_ptr<float[]> acc(new float[n_tasks * RT * D]);
  std::unique_ptr<float[]> ml(new float[n_tasks * 2 * RT]);
  float* acc_p = acc.get();
  float* ml_p = ml.get();
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / tasks, c = i % tasks;
      Rows rows{RT, D, acc_p + i * RT * D, ml_p + i * 2 * RT, ml_p + i * 2 * RT + RT};
      std::fill(rows.acc, rows.acc + RT * D, 0.f);
      std::fill(rows.m, rows.m + RT, NEG_INF);
      std::fill(rows.l, rows.l + RT, 0.f);
#ifdef QSPEC_AVX2
      if (D == 64) {
        run_task<64>(a, bh, c, rows);
        continue;
      }
      if (D == 128) {
        run_task<128>(a, bh, c, rows);
        continue;
      }
#endif
      run_task<0>(a, bh, c, rows);
    }
  });
  // log-sum-exp merge over tasks, written to [B, T, H, D] with dims re-interleaved
  auto out = torch::empty({B, T, H, D}, torch::kFloat);
  float* out_p = out.data_ptr<float>();
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
      for (int64_t d = 0; d < D; ++d) dst[perm[d]] = o[d];
    }
  }
  return out.permute({0, 2, 1, 3});
}
