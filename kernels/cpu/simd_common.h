// Pieces of the SIMD layer that more than one ISA file shares (included by them):
//   cephes_exp<L>   the softmax's exp on any lane type L (Lanes8, Lanes16), one sequence of
//                   operations, so each ISA's bits are the ones its own copy gave;
//   dot_prefix_lanes<L>   a fixed-order dot's whole vectors of L's lanes (the attention's
//                   dot_prefix on x86: Lanes8 on AVX2, Lanes16 on AVX-512);
//   DotLanes<L>     an integer dot's float side in L's lanes (Dot64, Int4: Lanes8, Lanes16 on
//                   x86, F8Lanes on NEON, OneLane on portable builds);
//   CodesScalar, AttnScalar   the "no vector pass" halves of the layer (CodesScalar: AVX2,
//                   NEON, portable; AttnScalar: NEON, portable).
#pragma once
#include <cstdint>

namespace simd {

// exp(x) for the softmax (x <= 0), Cephes' polynomial: a few ulp; exp(-inf) = 0. L gives
// set, min, max, floor, fma (a * b + c), fnma (c - a * b), mul, add and pow2 (2^n for
// integral n in float lanes).
template <class L>
inline typename L::V cephes_exp(typename L::V x) {
  x = L::min(L::max(x, L::set(-88.3762626647949f)), L::set(88.3762626647949f));
  const typename L::V fx = L::floor(L::fma(x, L::set(1.44269504088896341f), L::set(0.5f)));
  x = L::fnma(fx, L::set(0.693359375f), x);
  x = L::fnma(fx, L::set(-2.12194440e-4f), x);
  typename L::V y = L::set(1.9875691500e-4f);
  y = L::fma(y, x, L::set(1.3981999507e-3f));
  y = L::fma(y, x, L::set(8.3334519073e-3f));
  y = L::fma(y, x, L::set(4.1665795894e-2f));
  y = L::fma(y, x, L::set(1.6666665459e-1f));
  y = L::fma(y, x, L::set(5.0000001201e-1f));
  y = L::add(L::fma(y, L::mul(x, x), x), L::set(1.f));
  return L::mul(y, L::pow2(fx));
}

// sum_d a_d b_d over the first dims, a multiple of L::kLanes (returned): one multiply-add
// chain per lane, then L's sum (its fixed order); the caller's scalar loop does the rest.
template <class L>
inline int64_t dot_prefix_lanes(const float* a, const float* b, int64_t D, float& sum) {
  int64_t d = 0;
  typename L::V acc = L::set(0.f);
  for (; d + L::kLanes <= D; d += L::kLanes) acc = L::fma(L::load(a + d), L::load(b + d), acc);
  sum = L::sum(acc);
  return d;
}

// The float side of an integer dot (Dot64, Int4) whose accumulators are L's lanes (L: V, set,
// sum): a chunk's exact int32 lanes, converted, are multiply-added into Acc; sum reduces in L's
// fixed order.
template <class L>
struct DotLanes {
  using Acc = typename L::V;
  static Acc zero() { return L::set(0.f); }
  static Acc set1(float v) { return L::set(v); }
  static float sum(Acc v) { return L::sum(v); }
};

// The activations' rounding (isa.h's round_to_codes) with no vector pass: the scalar loop
// does all of x.
struct CodesScalar {
  static int64_t abs_max(const float*, int64_t, float&, bool&) { return 0; }
  template <typename Code>
  static int64_t round(const float*, int64_t, float, Code*) { return 0; }
};

// The attention with no vector path (kVector false: attention_math.h's portable kernels,
// whose bits such a build keeps); dot_prefix sums no dims (attention_int.h's scalar loop does).
struct AttnScalar {
  static constexpr bool kVector = false;
  static int64_t dot_prefix(const float*, const float*, int64_t, float& sum) {
    sum = 0.f;
    return 0;
  }
};

}  // namespace simd
