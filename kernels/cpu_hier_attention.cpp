// Flash-decoding over the hierarchical INT4/INT8 KV cache, for CPUs.
//
// The twin of kernels/hier_attention.py (Triton) with the same arguments, for the CPU that
// has no Triton: the packed nibble planes are dequantized a token at a time into a D-float
// row in L1 and consumed at once, so no full-precision copy of the history is ever built.
// Work splits into (batch x KV head x chunk of history) tasks over torch's thread pool, each
// leaving softmax partials (acc, max, sum) that a final pass merges by log-sum-exp; the
// full-precision region is one more task per head.
//
// Layout (one layer): q [B, H, T, D] fp32; planes [B, n_kv, S, D/2] uint8 with dim 2i in the
// low nibble of byte i and 2i+1 in the high one; k_scale/k_zero [B, n_kv, S/G, D] (keys per
// channel per G tokens); v_scale/v_zero [B, n_kv, S, D/G] (values per token per G channels);
// fp_k/fp_v [B, n_kv, F, D] fp32. Inside, a head's D dims are kept "deinterleaved" (even dims,
// then odd dims): each byte's two nibbles land in two contiguous halves, so every inner loop
// is a plain stride-1 loop that the compiler vectorizes. q and the output are permuted alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t BLOCK = 32;  // tokens dequantized together (fewer when G < 32)

struct Args {
  const float* q;  // [B, n_kv, RT, D] scaled and deinterleaved
  const uint8_t *ku, *kl, *vu, *vl;
  const float *ks, *kz, *vs, *vz;
  const float *fk, *fv;
  const int64_t *nq, *fp_lo, *pos;
  int64_t B, n_kv, R, T, D, S, G, F, n_fp, fp_pos0, chunk, n_chunks;
  bool target;
};

// Online-softmax state of the R*T query rows of one KV head over one task's keys.
struct Rows {
  int64_t RT, D;
  float* __restrict acc;  // [RT, D]
  float* __restrict m;    // [RT]
  float* __restrict l;    // [RT]
};

// Nibble rows -> codes, deinterleaved (low nibbles = even dims first, then high = odd dims):
// U (draft) or 16 U + L with L = lower - 8 (target), as floats. out [n, D].
template <int64_t DT>
inline void block_codes(const uint8_t* __restrict up, const uint8_t* __restrict lo, int64_t n,
                        int64_t d_runtime, bool target, float* __restrict out) {
  const int64_t D = DT ? DT : d_runtime, half = D / 2;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* u = up + j * half;
    float* o = out + j * D;
    if (!target) {
      for (int64_t i = 0; i < half; ++i) o[i] = float(u[i] & 15);
      for (int64_t i = 0; i < half; ++i) o[half + i] = float(u[i] >> 4);
    } else {
      const uint8_t* w = lo + j * half;
      for (int64_t i = 0; i < half; ++i) o[i] = float(16 * (u[i] & 15) + (w[i] & 15) - 8);
      for (int64_t i = 0; i < half; ++i) o[half + i] = float(16 * (u[i] >> 4) + (w[i] >> 4) - 8);
    }
  }
}

// Fold keys k [n, D] (deinterleaved) into the rows that see them (`sees[r]`): scores, then the
// online softmax update with values v [n, D]. `mask(r, j)` (optional) hides single keys.
template <typename Mask>
void update(const Args& a, const float* __restrict q, const float* __restrict k,
            const float* __restrict v, int64_t n, const bool* sees, Mask mask, Rows& rows,
            float* __restrict scores) {
  const int64_t D = a.D;
  for (int64_t r = 0; r < rows.RT; ++r) {
    if (!sees[r]) continue;
    const float* __restrict qr = q + r * D;
    float mx = rows.m[r];
    for (int64_t j = 0; j < n; ++j) {
      const float* __restrict kj = k + j * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
      scores[j] = mask(r, j) ? dot : NEG_INF;
      mx = std::max(mx, scores[j]);
    }
    if (mx == NEG_INF) continue;
    const float corr = std::exp(rows.m[r] - mx);  // 0 when m was -inf
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      scores[j] = std::exp(scores[j] - mx);
      sum += scores[j];
    }
    float* __restrict ar = rows.acc + r * D;
    for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
    for (int64_t j = 0; j < n; ++j) {
      const float p = scores[j];
      const float* __restrict vj = v + j * D;
      for (int64_t d = 0; d < D; ++d) ar[d] += p * vj[d];
    }
    rows.l[r] = rows.l[r] * corr + sum;
    rows.m[r] = mx;
  }
}

// The quantized history, with the dequantization folded into the math instead of the data:
//   K (per channel): q . k_j = sum_d (q_d s_d) c_jd + sum_d q_d z_d, so q is scaled once per
//     K group and the dot runs on the raw codes c;
//   V (per token, one group): sum_j p_j (s_j c_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j.
// Codes are U (draft) or 16 U + L (target, with s / 16 as the step).
// DT: head_dim known at compile time (64, 128; 0 = read it from `a`), so that the short
// inner loops over D are fully unrolled and their accumulators stay in registers.
template <int64_t DT>
void quantized_task_t(const Args& a, int64_t bh, int64_t c, Rows& rows) {
  const int64_t D = DT ? DT : a.D, half = D / 2, G = a.G, RT = rows.RT;
  const int64_t max_nq = *std::max_element(a.nq, a.nq + a.T);
  const int64_t start = c * a.chunk, stop = std::min(start + a.chunk, max_nq);
  const float div = a.target ? 16.f : 1.f;
  const int64_t vgroups = D / G;
  std::vector<float> kb(BLOCK * D), vb(BLOCK * D), p(BLOCK), w(BLOCK), scale(D), zero(D);
  std::vector<float> qs(RT * D), kbias(RT), zacc(RT, 0.f);
  std::vector<char> sees(RT);
  const float* q = a.q + bh * RT * D;
  int64_t group = -1;
  const int64_t block = std::min(BLOCK, G);  // a block must not straddle two K groups
  for (int64_t b0 = start; b0 < stop; b0 += block) {
    const int64_t n = std::min(block, stop - b0);
    bool any = false;
    for (int64_t r = 0; r < RT; ++r) {  // history is all-or-nothing per G-aligned block
      sees[r] = b0 < a.nq[r % a.T];
      any |= sees[r];
    }
    if (!any) continue;
    const int64_t g = b0 / G;  // a block lies within one K group (G is a power of two)
    if (g != group) {
      group = g;
      const float* ks = a.ks + (bh * (a.S / G) + g) * D;
      const float* kz = a.kz + (bh * (a.S / G) + g) * D;
      for (int64_t i = 0; i < half; ++i) {
        scale[i] = ks[2 * i] / div, scale[half + i] = ks[2 * i + 1] / div;
        zero[i] = kz[2 * i], zero[half + i] = kz[2 * i + 1];
      }
      for (int64_t r = 0; r < RT; ++r) {
        float bias = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          qs[r * D + d] = q[r * D + d] * scale[d];
          bias += q[r * D + d] * zero[d];
        }
        kbias[r] = bias;
      }
    }
    const int64_t row0 = bh * a.S + b0;
    block_codes<DT>(a.ku + row0 * half, a.kl + row0 * half, n, D, a.target, kb.data());
    block_codes<DT>(a.vu + row0 * half, a.vl + row0 * half, n, D, a.target, vb.data());
    const float* vs = a.vs + row0 * vgroups;
    const float* vz = a.vz + row0 * vgroups;
    if (vgroups > 1) {  // several V groups per token: dequantize the values in place
      for (int64_t j = 0; j < n; ++j) {
        float* __restrict vr = vb.data() + j * D;
        for (int64_t d = 0; d < D; ++d) {  // deinterleaved dim d is original 2d or 2(d-half)+1
          const int64_t grp = (d < half ? 2 * d : 2 * (d - half) + 1) / G;
          vr[d] = vr[d] * (vs[j * vgroups + grp] / div) + vz[j * vgroups + grp];
        }
      }
    }
    for (int64_t r = 0; r < RT; ++r) {
      if (!sees[r]) continue;
      const float* __restrict qr = qs.data() + r * D;
      float mx = rows.m[r];
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {  // four tokens at a time: four independent FMA chains
        const float* __restrict k0 = kb.data() + j * D;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          s0 += qr[d] * k0[d];
          s1 += qr[d] * k0[D + d];
          s2 += qr[d] * k0[2 * D + d];
          s3 += qr[d] * k0[3 * D + d];
        }
        p[j] = s0 + kbias[r], p[j + 1] = s1 + kbias[r];
        p[j + 2] = s2 + kbias[r], p[j + 3] = s3 + kbias[r];
      }
      for (; j < n; ++j) {
        const float* __restrict kj = kb.data() + j * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
        p[j] = dot + kbias[r];
      }
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[i]);
      const float corr = std::exp(rows.m[r] - mx);  // 0 while m was -inf
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      float* __restrict ar = rows.acc + r * D;
      for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      float z = zacc[r] * corr;
      for (int64_t j = 0; j < n; ++j) {
        w[j] = vgroups == 1 ? p[j] * (vs[j] / div) : p[j];  // (else: vb holds values)
        if (vgroups == 1) z += p[j] * vz[j];
      }
      zacc[r] = z;
      // 32 dims at a time: the slice of acc stays in registers across the block's tokens
      int64_t h = 0;
      for (; h + 32 <= D; h += 32) {
        float part[32];
        for (int64_t d = 0; d < 32; ++d) part[d] = ar[h + d];
        for (int64_t j = 0; j < n; ++j) {
          const float* __restrict vj = vb.data() + j * D + h;
          const float wj = w[j];
          for (int64_t d = 0; d < 32; ++d) part[d] += wj * vj[d];
        }
        for (int64_t d = 0; d < 32; ++d) ar[h + d] = part[d];
      }
      for (int64_t j = 0; h < D && j < n; ++j) {  // head_dim not a multiple of 32
        for (int64_t d = h; d < D; ++d) ar[d] += w[j] * vb[j * D + d];
      }
      rows.l[r] = rows.l[r] * corr + sum;
      rows.m[r] = mx;
    }
  }
  for (int64_t r = 0; r < RT; ++r) {  // the values' zeros, sum_j p_j z_j, reach every dim
    float* __restrict ar = rows.acc + r * D;
    for (int64_t d = 0; d < D; ++d) ar[d] += zacc[r];
  }
}

void quantized_task(const Args& a, int64_t bh, int64_t c, Rows& rows) {
  if (a.D == 64) {
    quantized_task_t<64>(a, bh, c, rows);
  } else if (a.D == 128) {
    quantized_task_t<128>(a, bh, c, rows);
  } else {
    quantized_task_t<0>(a, bh, c, rows);
  }
}

void full_precision_task(const Args& a, int64_t bh, Rows& rows) {
  const int64_t D = a.D, half = D / 2, RT = rows.RT, n = a.n_fp;
  std::vector<float> kb(std::max<int64_t>(n, 1) * D), vb(std::max<int64_t>(n, 1) * D);
  std::vector<float> scores(std::max<int64_t>(n, 1));
  const float* fk = a.fk + bh * a.F * D;
  const float* fv = a.fv + bh * a.F * D;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < half; ++i) {
      kb[j * D + i] = fk[j * D + 2 * i], kb[j * D + half + i] = fk[j * D + 2 * i + 1];
      vb[j * D + i] = fv[j * D + 2 * i], vb[j * D + half + i] = fv[j * D + 2 * i + 1];
    }
  }
  std::vector<char> sees(RT, 1);
  auto mask = [&](int64_t r, int64_t j) {
    const int64_t t = r % a.T;
    return a.fp_lo[t] <= j && a.fp_pos0 + j <= a.pos[t];
  };
  update(a, a.q + bh * RT * D, kb.data(), vb.data(), n, reinterpret_cast<bool*>(sees.data()),
         mask, rows, scores.data());
}

}  // namespace

// Returns [B, H, T, D] fp32. n_quant_q/fp_lo/input_pos: int64 [T].
torch::Tensor hier_attention_cpu(torch::Tensor q, torch::Tensor k_upper, torch::Tensor k_lower,
                                 torch::Tensor k_scale, torch::Tensor k_zero,
                                 torch::Tensor v_upper, torch::Tensor v_lower,
                                 torch::Tensor v_scale, torch::Tensor v_zero,
                                 torch::Tensor n_quant_q, torch::Tensor fp_k, torch::Tensor fp_v,
                                 int64_t n_fp, int64_t fp_pos0, torch::Tensor fp_lo,
                                 torch::Tensor input_pos, bool target, int64_t group_size,
                                 int64_t chunk) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t n_kv = k_upper.size(1), R = H / n_kv, RT = R * T;
  // [B, H, T, D] -> [B, n_kv, R*T, D], scaled, dims deinterleaved
  auto qd = (q.to(torch::kFloat) * (1.0 / std::sqrt(double(D))))
                .view({B, n_kv, R, T, D / 2, 2})
                .transpose(4, 5)
                .reshape({B, n_kv, RT, D})
                .contiguous();
  Args a;
  a.q = qd.data_ptr<float>();
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
  a.nq = n_quant_q.data_ptr<int64_t>();
  a.fp_lo = fp_lo.data_ptr<int64_t>();
  a.pos = input_pos.data_ptr<int64_t>();
  a.B = B, a.n_kv = n_kv, a.R = R, a.T = T, a.D = D, a.S = k_upper.size(2);
  a.G = group_size, a.F = fp_k.size(2), a.n_fp = n_fp, a.fp_pos0 = fp_pos0;
  a.chunk = chunk, a.target = target;
  const int64_t max_nq = n_quant_q.max().item<int64_t>();
  a.n_chunks = (max_nq + chunk - 1) / chunk;
  const int64_t tasks = a.n_chunks + 1;  // + the full-precision region
  auto acc = torch::empty({B * n_kv, tasks, RT, D}, torch::kFloat);
  auto ml = torch::empty({B * n_kv, tasks, 2, RT}, torch::kFloat);
  float* acc_p = acc.data_ptr<float>();
  float* ml_p = ml.data_ptr<float>();
  at::parallel_for(0, B * n_kv * tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / tasks, c = i % tasks;
      Rows rows{RT, D, acc_p + i * RT * D, ml_p + i * 2 * RT, ml_p + i * 2 * RT + RT};
      std::fill(rows.acc, rows.acc + RT * D, 0.f);
      std::fill(rows.m, rows.m + RT, NEG_INF);
      std::fill(rows.l, rows.l + RT, 0.f);
      if (c < a.n_chunks) {
        quantized_task(a, bh, c, rows);
      } else {
        full_precision_task(a, bh, rows);
      }
    }
  });
  // log-sum-exp merge over tasks, then back to [B, H, T, D] with dims re-interleaved
  auto out = torch::zeros({B * n_kv, RT, D}, torch::kFloat);
  float* out_p = out.data_ptr<float>();
  for (int64_t bh = 0; bh < B * n_kv; ++bh) {
    for (int64_t r = 0; r < RT; ++r) {
      float mx = NEG_INF;
      for (int64_t c = 0; c < tasks; ++c) mx = std::max(mx, ml_p[(bh * tasks + c) * 2 * RT + r]);
      if (mx == NEG_INF) continue;
      float denom = 0.f;
      float* o = out_p + (bh * RT + r) * D;
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
  }
  return out.view({B, n_kv, R, T, 2, D / 2}).transpose(4, 5).reshape({B, H, T, D});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hier_attention_cpu", &hier_attention_cpu, "hierarchical KV attention (CPU)");
}
