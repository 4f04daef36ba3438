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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QSPEC_AVX2 1
#endif

namespace {

constexpr int64_t MAX_BLOCK_ROWS = 8;  // rows of x per pass over the weights

// Rows per thread at the least: waking the thread pool costs tens of microseconds on a small
// VM, more than a layer of a 135M model takes on one core, so only large matrices (lm_head)
// are split. `row_bytes`: weight bytes per unit of work.
inline int64_t grain_rows(int64_t row_bytes) {
  constexpr int64_t MIN_BYTES_PER_THREAD = 256 << 10;
  return std::max<int64_t>(1, MIN_BYTES_PER_THREAD / std::max<int64_t>(row_bytes, 1));
}

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
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

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
  for (int r = 0; r < NR; ++r) {
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
// (a draft step). The twin is `kernels.cpu.linear.int4_linear_ref` (the same activation
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
