// y = x W^T (+ b) for a few rows of x (M <= 8), fp32, for CPUs: the decode and verify steps.
//
// A decode step is a stream over the weights: each weight row is read once from memory and
// used for every row of x, which sits in L1. PyTorch's GEMM for M = 2..8 does not stream
// like that here (a 5-token verify cost 1.8x a 1-token step on the same weights), so this
// kernel makes a verify of gamma + 1 tokens cost about what one token does.
//
// x [M, K] and W [N, K] row-major (stride 1 along K); out [M, N]. Rows of W are split over
// torch's thread pool; NR rows at a time, so that NR * M independent FMA chains hide the FMA
// latency. The sum over K runs in eight lanes and is reduced at the end: results equal
// F.linear's to rounding, not bit for bit.
#include <torch/extension.h>

#include "cpu_kernels.h"  // (the declarations these definitions must match)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QSPEC_AVX2 1
#endif

namespace {

// Rows per thread at the least: waking the thread pool costs tens of microseconds on a small
// VM, more than a layer of a 135M model takes on one core, so only large matrices (lm_head)
// are split. `row_bytes`: weight bytes per unit of work.
inline int64_t grain_rows(int64_t row_bytes) {
  constexpr int64_t MIN_BYTES_PER_THREAD = 256 << 10;
  return std::max<int64_t>(1, MIN_BYTES_PER_THREAD / std::max<int64_t>(row_bytes, 1));
}

#ifdef QSPEC_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// NR weight rows starting at n against all M rows of x.
template <int M, int NR>
inline void rows_avx2(const float* __restrict x, const float* __restrict w, int64_t K,
                      int64_t N, int64_t n, const float* bias, float* __restrict out) {
  __m256 acc[NR][M];  // (fully unrolled: every accumulator lives in a register)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = _mm256_loadu_ps(w + (n + r) * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) s += w[(n + r) * K + k] * x[m * K + k];
      out[m * N + n + r] = bias ? s + bias[n + r] : s;
    }
  }
}

template <int M>
void linear_avx2(const float* x, const float* w, const float* bias, float* out, int64_t K,
                 int64_t N) {
  constexpr int NR = M == 1 ? 8 : M == 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
  at::parallel_for(0, (N + NR - 1) / NR, grain_rows(4 * K * NR), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        rows_avx2<M, NR>(x, w, K, N, n, bias, out);
      } else {
        for (int64_t i = n; i < N; ++i) rows_avx2<M, 1>(x, w, K, N, i, bias, out);
      }
    }
  });
}
#endif

void linear_portable(const float* x, const float* w, const float* bias, float* out, int64_t M,
                     int64_t K, int64_t N) {
  at::parallel_for(0, N, grain_rows(4 * K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += w[n * K + k] * x[m * K + k];
        out[m * N + n] = bias ? s + bias[n] : s;
      }
    }
  });
}

}  // namespace

torch::Tensor linear_rows_cpu(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "fp32 only");
  TORCH_CHECK(x.size(0) <= 8, "at most 8 rows");
  x = x.is_contiguous() ? x : x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bias = nullptr;
  torch::Tensor bc;
  if (b.has_value() && b->defined()) {
    bc = b->to(torch::kFloat).contiguous();
    bias = bc.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, torch::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef QSPEC_AVX2
  switch (M) {
    case 1: linear_avx2<1>(xp, wp, bias, op, K, N); return out;
    case 2: linear_avx2<2>(xp, wp, bias, op, K, N); return out;
    case 3: linear_avx2<3>(xp, wp, bias, op, K, N); return out;
    case 4: linear_avx2<4>(xp, wp, bias, op, K, N); return out;
    case 5: linear_avx2<5>(xp, wp, bias, op, K, N); return out;
    case 6: linear_avx2<6>(xp, wp, bias, op, K, N); return out;
    case 7: linear_avx2<7>(xp, wp, bias, op, K, N); return out;
    case 8: linear_avx2<8>(xp, wp, bias, op, K, N); return out;
    default: break;
  }
#endif
  linear_portable(xp, wp, bias, op, M, K, N);
  return out;
}

// ---------------------------------------------------------------------------------------------
// The draft's 4-bit linear for a few rows (W4A8): y = x W^T with W[n, k] = (q - z) s per group,
// q packed two per byte ([N, K/2], even k in the low nibble), s/z fp32 [N, K/G].
//
// x is quantized to int8 per 64 inputs (symmetric, step max|x| / 127), as llama.cpp does for
// its Q4 x Q8 dot products, so that the inner product runs on integers: vpmaddubsw multiplies
// 32 nibbles (u8) by 32 int8 activations and adds pairs, exactly (|sum| <= 2 * 15 * 127). Per
// 64-input chunk c of row n:  sum_k (q - z) s xq dx = s dx (sum_k q xq - z sum_k xq).
// The zero-point term is summed per weight group from per-chunk step * sum(codes), computed
// once with the activations. Four weight rows share each activation load when x has one row
// (a draft step). The twin is `kernels.cpu_linear.int4_linear_ref` (the same activation
// rounding, then a dense matmul); this is the draft path only, whose output only proposes
// tokens.
namespace {

struct QuantRows {  // x [M, K] -> per 64-chunk: even/odd int8 halves, step; per group: zsum
  std::vector<int8_t> even, odd;  // [M, K/64, 32]
  std::vector<float> step;        // [M, K/64]
  std::vector<float> zsum;        // [M, K/G]: sum over the group's chunks of step * sum(codes)
};

QuantRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t G) {
  const int64_t C = K / 64, per_group = G / 64;
  QuantRows r{std::vector<int8_t>(M * C * 32), std::vector<int8_t>(M * C * 32),
              std::vector<float>(M * C), std::vector<float>(M * (K / G), 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < C; ++c) {
      const float* xc = x + m * K + c * 64;
      float amax = 0.f;
      for (int i = 0; i < 64; ++i) amax = std::max(amax, std::abs(xc[i]));
      const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      int8_t* even = &r.even[(m * C + c) * 32];
      int8_t* odd = &r.odd[(m * C + c) * 32];
      for (int i = 0; i < 32; ++i) {
        // lrintf rounds half to even (the default rounding mode), as torch.round does
        const int e = int(lrintf(xc[2 * i] * inv)), o = int(lrintf(xc[2 * i + 1] * inv));
        even[i] = int8_t(e);
        odd[i] = int8_t(o);
        sum += e + o;
      }
      r.step[m * C + c] = step;
      r.zsum[m * (K / G) + c / per_group] += step * float(sum);
    }
  }
  return r;
}

#ifdef QSPEC_AVX2
// NR weight rows from n against M rows of x. Per 64-input chunk c and row pair (r, m):
// acc += s[r, g] * step[m, c] * sum_k q x_codes (integers, exact); the zero points after.
template <int M, int NR>
inline void int4_block(const QuantRows& xq, const uint8_t* packed, const float* scale,
                       const float* zero, const float* bias, float* out, int64_t K, int64_t N,
                       int64_t G, int64_t n) {
  const int64_t C = K / 64, NG = K / G, per_group = G / 64;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[NR][M];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0, c = 0; g < NG; ++g) {
    __m256 sv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) sv[r] = _mm256_set1_ps(scale[(n + r) * NG + g]);
    for (int64_t cc = 0; cc < per_group; ++cc, ++c) {
      __m256i lo[NR], hi[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m256i b = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(packed + (n + r) * (K / 2) + c * 32));
        lo[r] = _mm256_and_si256(b, mask);
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t at = (m * C + c) * 32;
        const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.even[at]));
        const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.odd[at]));
        const __m256 step = _mm256_broadcast_ss(&xq.step[m * C + c]);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], e),
                                               _mm256_maddubs_epi16(hi[r], o));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
          acc[r][m] = _mm256_fmadd_ps(_mm256_mul_ps(p, step), sv[r], acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float* s = scale + (n + r) * NG;
    const float* z = zero + (n + r) * NG;
    for (int m = 0; m < M; ++m) {
      float y = hsum(acc[r][m]);
      for (int64_t g = 0; g < NG; ++g) y -= s[g] * z[g] * xq.zsum[m * NG + g];
      out[m * N + n + r] = bias ? y + bias[n + r] : y;
    }
  }
}
#endif

template <int M>
void int4_rows(const QuantRows& xq, const uint8_t* packed, const float* scale, const float* zero,
               const float* bias, float* out, int64_t K, int64_t N, int64_t G) {
#ifdef QSPEC_AVX2
  // NR weight rows share each activation load; four for one row of x (a draft step)
  constexpr int NR = M == 1 ? 4 : M == 2 ? 2 : 1;
  at::parallel_for(0, (N + NR - 1) / NR, grain_rows(K / 2 * NR), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        int4_block<M, NR>(xq, packed, scale, zero, bias, out, K, N, G, n);
      } else {
        for (int64_t i = n; i < N; ++i)
          int4_block<M, 1>(xq, packed, scale, zero, bias, out, K, N, G, i);
      }
    }
  });
#else
  const int64_t C = K / 64, NG = K / G, per_group = G / 64;
  at::parallel_for(0, N, grain_rows(K / 2), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = packed + n * (K / 2);
      const float* s = scale + n * NG;
      const float* z = zero + n * NG;
      for (int m = 0; m < M; ++m) {
        float y = 0.f;
        for (int64_t c = 0; c < C; ++c) {
          int dot = 0;
          for (int i = 0; i < 32; ++i) {
            const uint8_t byte = row[c * 32 + i];
            dot += (byte & 15) * xq.even[(m * C + c) * 32 + i];
            dot += (byte >> 4) * xq.odd[(m * C + c) * 32 + i];
          }
          y += float(dot) * s[c / per_group] * xq.step[m * C + c];
        }
        for (int64_t g = 0; g < NG; ++g) y -= s[g] * z[g] * xq.zsum[m * NG + g];
        out[m * N + n] = bias ? y + bias[n] : y;
      }
    }
  });
#endif
}

}  // namespace

torch::Tensor int4_rows_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                            torch::Tensor zero, int64_t group_size,
                            c10::optional<torch::Tensor> b) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "at most 8 rows");
  TORCH_CHECK(K % 64 == 0 && group_size % 64 == 0 && K % group_size == 0,
              "K and the group size must be multiples of 64");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.size(1) * 2 == K, "packed [N, K/2]");
  x = x.is_contiguous() ? x : x.contiguous();
  packed = packed.is_contiguous() ? packed : packed.contiguous();
  scale = scale.to(torch::kFloat).contiguous();
  zero = zero.to(torch::kFloat).contiguous();
  const float* bias = nullptr;
  torch::Tensor bc;
  if (b.has_value() && b->defined()) {
    bc = b->to(torch::kFloat).contiguous();
    bias = bc.data_ptr<float>();
  }
  const QuantRows xq = quantize_rows(x.data_ptr<float>(), M, K, group_size);
  auto out = torch::empty({M, N}, torch::kFloat);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
    case 1: int4_rows<1>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    case 2: int4_rows<2>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    case 3: int4_rows<3>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    case 4: int4_rows<4>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    case 5: int4_rows<5>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    case 6: int4_rows<6>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    case 7: int4_rows<7>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
    default: int4_rows<8>(xq, pp, sp, zp, bias, op, K, N, group_size); break;
  }
  return out;
}
