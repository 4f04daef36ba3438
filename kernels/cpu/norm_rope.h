// The row cores of decode.cpp's RMSNorm and RoPE, torch-free (the test driver in
// kernels/cpu/tests calls them on raw pointers).
#pragma once
#include <cmath>
#include <cstdint>

// Sum of squares in double-free fp32, eight lanes (the compiler vectorizes this loop).
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict y,
                     int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / float(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

// RMSNorm of M rows [M, H]: y = norm(x).
inline void norm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) norm_row(x + m * H, w, y + m * H, H, eps);
}

// x += h in place, then y = norm(x), row by row [M, H] (the residual add before a norm).
inline void add_norm_rows(float* x, const float* h, const float* w, float* y, int64_t M,
                          int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < H; ++i) x[m * H + i] += h[m * H + i];
    norm_row(x + m * H, w, y + m * H, H, eps);
  }
}

// Rotate-half RoPE in place on one head's row r [D] with the position's cos/sin [D].
inline void rope_row(float* r, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {  // (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    const float x1 = r[i], x2 = r[half + i];
    r[i] = x1 * c[i] - x2 * s[i];
    r[half + i] = x2 * c[half + i] + x1 * s[half + i];
  }
}
