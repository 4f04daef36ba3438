// The torch-free core the CPU kernels share: the SIMD layer (simd.h: which instruction set
// paths this build compiles, QSPEC_AVX2, QSPEC_AVX512_VNNI, QSPEC_AVX_VNNI on x86-64,
// QSPEC_NEON, QSPEC_NEON_DOTPROD on aarch64, portable C++ otherwise), the activations'
// rounding, the thread-pool grain. Included by kernels.h and by the torch-free test driver
// (kernels/cpu/tests/driver.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "simd.h"  // the QSPEC_* paths and the SIMD layer (simd::F8, simd::Dot64, ...)

using simd::hsum;  // (the 8-lane sum in its one fixed order, for the kernels not on simd:: yet)

// Rows per thread at the least: waking the thread pool costs tens of microseconds on a small
// VM, more than a layer of a 135M model takes on one core, so only large matrices (lm_head)
// are split. `row_bytes`: weight bytes per unit of work.
inline int64_t grain_rows(int64_t row_bytes) {
  constexpr int64_t MIN_BYTES_PER_THREAD = 256 << 10;
  return std::max<int64_t>(1, MIN_BYTES_PER_THREAD / std::max<int64_t>(row_bytes, 1));
}

// Asks for the cache line at p, into L2, not L1 (locality 1: prefetcht2): a core has few L1
// miss buffers, and prefetches into L1 filled them (perf on Zen 4: a fifth of a W4A8 pass's
// samples stalled on its prefetcht0); into L2, one-row passes from memory went from 10.7 to
// 23-24 GB/s (W8A8) and from 14.5 to 21-25 GB/s (W4A8) on two cores. Every prefetch of the
// kernels goes through here. (A prefetch never faults, past the end of a buffer included.)
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

// Asks for the cache line at p + 2 * block_bytes: the same column of the weight rows two blocks
// of NR rows ahead. The hardware prefetchers see NR interleaved streams of K bytes each, too
// short to train on, and a pass from cold memory ran at a third of the bandwidth without this.
inline void prefetch_ahead(const void* p, int64_t block_bytes) {
  prefetch_l2(static_cast<const char*>(p) + 2 * block_bytes);
}

// Rounds x[0, n) to integer codes in -L..L (symmetric: step max|x| / L, ties to even), L = 127
// for int8 codes, 32767 for int16; returns the step. The integer-dot linears round
// activations to int8 per 64 inputs, the attention its queries to int16 per head. Below
// kMinAmax (L / amax would overflow near 4e-37 for int8) x counts as zero: codes 0, step 0;
// a NaN or an infinity anywhere gives codes 0 and a NaN step, so a NaN reaches the output
// whatever kernel sums the codes (an infinity's L / amax = 0 made NaN codes, which rounded to
// -128 and gave a GEMM a finite-looking infinity of either sign). The twin:
// `kernels.formats.round_symmetric`, which rounds the same way.
constexpr float kMinAmax = 1e-30f;
template <typename Code>
inline float round_to_codes(const float* x, int64_t n, Code* codes) {
  static_assert(std::is_same_v<Code, int8_t> || std::is_same_v<Code, int16_t>);
  float amax = 0.f;
  bool nan = false;
  int64_t i = simd::Codes::abs_max(x, n, amax, nan);  // a vector pass's prefix of x, if any
  for (; i < n; ++i) {
    amax = std::max(amax, std::abs(x[i]));
    nan |= std::isnan(x[i]);
  }
  // (volatile: -ffast-math would turn amax / L into amax * (1 / L), an ulp off the twin's)
  volatile float levels = std::is_same_v<Code, int8_t> ? 127.f : 32767.f;
  nan |= std::isinf(amax);
  if (nan || !(amax >= kMinAmax)) {
    for (int64_t k = 0; k < n; ++k) codes[k] = 0;
    return nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
  }
  const float inv = levels / amax;
  i = simd::Codes::round(x, n, inv, codes);
  // lrintf rounds half to even (the default rounding mode), as torch.round does
  for (; i < n; ++i) codes[i] = Code(lrintf(x[i] * inv));
  return amax / levels;
}
