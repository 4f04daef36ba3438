// y = x W^T (+ b) for the few rows of a decode or verify step (M <= 17), for CPUs.
//
// A decode step is a stream over the weights: each weight row is read once from memory and
// used for every row of x, which sits in L1. PyTorch's GEMM for M = 2..8 does not stream
// like that here (a 5-token verify cost 1.8x a 1-token step on the same weights), so this
// kernel makes a verify of gamma + 1 tokens cost about what one token does.
//
// Batch invariance (what greedy QuantSpec == target-ar rests on): each output y[m, n] is
// computed by the same instructions in the same order whatever M is and wherever row m sits
// in x: eight fp32 lanes over K in steps of 8, one fixed horizontal sum, the K % 8 tail in
// order, then scale and bias. PyTorch's GEMMs pick other kernels, splits and reduction orders
// for M = 1 and M = 5 (bf16 and int8 on AVX-512 machines measurably), so a token's logits
// inside a verify would not be those of the same token decoded alone.
//
// Weights: fp32, bf16 or fp16 [N, K] (converted to fp32 in registers), or int8 [N, K] with
// an fp32 scale per row (W8, the INT8 target: y = scale[n] * sum_k x q + b). Activations are
// fp32 (callers upcast bf16/fp16 rows exactly). x [M, K] and W [N, K] row-major (stride 1
// along K); out [M, N] fp32. Rows of W are split over torch's thread pool, NR at a time, so
// that NR * M independent FMA chains hide the FMA latency; x goes in blocks of at most 8 rows.
#include <torch/extension.h>

#include "kernels.h"  // (the declarations these definitions must match)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t MAX_BLOCK_ROWS = 8;  // rows of x per pass over the weights

// One weight element as fp32 (the scalar tail and the portable path).
inline float to_f32(float w) { return w; }
inline float to_f32(c10::BFloat16 w) { return static_cast<float>(w); }
inline float to_f32(c10::Half w) { return static_cast<float>(w); }
inline float to_f32(int8_t w) { return static_cast<float>(w); }

// y = s * scale + bias, the same expression for every row and every M.
inline float finish(float s, const float* scale, const float* bias, int64_t n) {
  if (scale) s *= scale[n];
  return bias ? s + bias[n] : s;
}

#ifdef QSPEC_AVX2
// Eight weights from p as fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  int64_t bits;
  std::memcpy(&bits, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}

// NR weight rows starting at n against the M rows of x.
template <int M, int NR, typename W>
inline void rows_avx2(const float* __restrict x, const W* __restrict w, int64_t K, int64_t N,
                      int64_t n, const float* scale, const float* bias, float* __restrict out) {
  __m256 acc[NR][M];  // (fully unrolled: every accumulator lives in a register)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = load8(w + (n + r) * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  // (unrolled like the loops above: an indexed read would keep acc in memory, not registers)
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t k = K8; k < K; ++k) s += to_f32(w[(n + r) * K + k]) * x[m * K + k];
      out[m * N + n + r] = finish(s, scale, bias, n + r);
    }
  }
}

template <int M, typename W>
void block_avx2(const float* x, const W* w, const float* scale, const float* bias, float* out,
                int64_t K, int64_t N) {
  constexpr int NR = M == 1 ? 8 : M == 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
  const int64_t row_bytes = int64_t(sizeof(W)) * K * NR;
  at::parallel_for(0, (N + NR - 1) / NR, grain_rows(row_bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        rows_avx2<M, NR>(x, w, K, N, n, scale, bias, out);
      } else {
        for (int64_t i = n; i < N; ++i) rows_avx2<M, 1>(x, w, K, N, i, scale, bias, out);
      }
    }
  });
}

// x rows [0, M) (M <= 8) against all of W; out rows have stride N.
template <typename W>
void block(const float* x, const W* w, const float* scale, const float* bias, float* out,
           int64_t M, int64_t K, int64_t N) {
  switch (M) {
    case 1: return block_avx2<1>(x, w, scale, bias, out, K, N);
    case 2: return block_avx2<2>(x, w, scale, bias, out, K, N);
    case 3: return block_avx2<3>(x, w, scale, bias, out, K, N);
    case 4: return block_avx2<4>(x, w, scale, bias, out, K, N);
    case 5: return block_avx2<5>(x, w, scale, bias, out, K, N);
    case 6: return block_avx2<6>(x, w, scale, bias, out, K, N);
    case 7: return block_avx2<7>(x, w, scale, bias, out, K, N);
    default: return block_avx2<8>(x, w, scale, bias, out, K, N);
  }
}
#else
// Portable: the same order for every row (eight partial sums over K, summed pairwise), so
// the result does not depend on M here either. (-ffast-math may vectorize this loop, but the
// loop and so the order are the same for every row.)
template <typename W>
void block(const float* x, const W* w, const float* scale, const float* bias, float* out,
           int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, grain_rows(int64_t(sizeof(W)) * K), [&](int64_t n0, int64_t n1) {
    const int64_t K8 = K & ~int64_t(7);
    for (int64_t n = n0; n < n1; ++n) {
      const W* wr = w + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t k = 0; k < K8; k += 8)
          for (int j = 0; j < 8; ++j) lane[j] += to_f32(wr[k + j]) * xr[k + j];
        float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                  ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        for (int64_t k = K8; k < K; ++k) s += to_f32(wr[k]) * xr[k];
        out[m * N + n] = finish(s, scale, bias, n);
      }
    }
  });
}
#endif

template <typename W>
void rows(const float* x, const W* w, const float* scale, const float* bias, float* out,
          int64_t M, int64_t K, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_BLOCK_ROWS)
    block(x + m0 * K, w, scale, bias, out + m0 * N, std::min(MAX_BLOCK_ROWS, M - m0), K, N);
}

// Checks shared by both entry points; returns x as contiguous fp32 [M, K] and the bias.
torch::Tensor check_rows(const torch::Tensor& x, const torch::Tensor& w,
                         const c10::optional<torch::Tensor>& b, torch::Tensor* bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "x must be fp32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxStepRows, "1 to ", kMaxStepRows, " rows");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  if (b.has_value() && b->defined()) *bias = b->to(torch::kFloat).contiguous();
  return x.is_contiguous() ? x : x.contiguous();
}

}  // namespace

torch::Tensor linear_rows_cpu(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b) {
  torch::Tensor bias;
  x = check_rows(x, w, b, &bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, torch::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case torch::kFloat: rows(xp, w.data_ptr<float>(), nullptr, bp, op, M, K, N); break;
    case torch::kBFloat16:
      rows(xp, w.data_ptr<c10::BFloat16>(), nullptr, bp, op, M, K, N);
      break;
    case torch::kHalf: rows(xp, w.data_ptr<c10::Half>(), nullptr, bp, op, M, K, N); break;
    default: TORCH_CHECK(false, "weights must be fp32, bf16 or fp16");
  }
  return out;
}

torch::Tensor int8_rows_cpu(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                            c10::optional<torch::Tensor> b) {
  torch::Tensor bias;
  x = check_rows(x, w, b, &bias);
  TORCH_CHECK(w.scalar_type() == torch::kChar, "int8 weights [N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == w.size(0) &&
                  scale.is_contiguous(),
              "fp32 scale [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, torch::kFloat);
  rows(x.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
       bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K, N);
  return out;
}
