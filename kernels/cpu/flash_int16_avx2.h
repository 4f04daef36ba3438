// flash_int16.h's int16 dot products on 256 bits: the AVX2 build (`vpmaddwd`, two int16
// products per int32 lane, then `vpaddd`: 16 multiply-adds per two instructions, where an FMA
// does 8) and the AVX-VNNI build (`vpdpwssd` on ymm: both in one), on flash_prefill.h's
// 16-register tiles: score tiles of ST = 3 rows x NV = 4 vectors of keys, the keys memory
// operands; value sums kColumns vectors x kColumnRows rows at a time (`value_columns`).
//
// Included by flash_int16.h inside namespace flash::int16, after ProductsBase.

// s[c] += a[c] . the word at w, broadcast (two int16 products per int32 lane), c < N; a[c]
// in memory (the keys, unaligned) or in registers (the values, loaded). One asm block a
// row: as intrinsics GCC 12 hoisted every row's broadcast and spilled the accumulators of 16
// registers (int_gemm.h's Form::row, the same fix). Same instructions, same bits.
template <int N>
inline void dot_words(__m256i (&s)[N], const void* vectors, const int16_t* w) {
  static_assert(N == 2 || N == 4);
  // (unaligned: a template's deduced vector type would drop __m256i_u's alignment)
  const __m256i_u* a = static_cast<const __m256i_u*>(vectors);
#if defined(__GNUC__) && !defined(__clang__)
  __m256i b;
  const int32_t& word = *reinterpret_cast<const int32_t*>(w);
#if defined(QSPEC_AVX_VNNI)
#define QSPEC_DOT(i) "%{vex%} vpdpwssd %[a" #i "], %[b], %[s" #i "]\n\t"
  if constexpr (N == 2) {
    asm("vpbroadcastd %[w], %[b]\n\t" QSPEC_DOT(0) QSPEC_DOT(1)
        : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [b] "=&x"(b)
        : [a0] "xm"(a[0]), [a1] "xm"(a[1]), [w] "m"(word));
  } else {
    asm("vpbroadcastd %[w], %[b]\n\t" QSPEC_DOT(0) QSPEC_DOT(1) QSPEC_DOT(2) QSPEC_DOT(3)
        : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]), [s3] "+x"(s[3]), [b] "=&x"(b)
        : [a0] "xm"(a[0]), [a1] "xm"(a[1]), [a2] "xm"(a[2]), [a3] "xm"(a[3]), [w] "m"(word));
  }
#else
  __m256i t;
#define QSPEC_DOT(i) "vpmaddwd %[a" #i "], %[b], %[t]\n\tvpaddd %[t], %[s" #i "], %[s" #i "]\n\t"
  if constexpr (N == 2) {
    asm("vpbroadcastd %[w], %[b]\n\t" QSPEC_DOT(0) QSPEC_DOT(1)
        : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [b] "=&x"(b), [t] "=&x"(t)
        : [a0] "xm"(a[0]), [a1] "xm"(a[1]), [w] "m"(word));
  } else {
    asm("vpbroadcastd %[w], %[b]\n\t" QSPEC_DOT(0) QSPEC_DOT(1) QSPEC_DOT(2) QSPEC_DOT(3)
        : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]), [s3] "+x"(s[3]), [b] "=&x"(b),
          [t] "=&x"(t)
        : [a0] "xm"(a[0]), [a1] "xm"(a[1]), [a2] "xm"(a[2]), [a3] "xm"(a[3]), [w] "m"(word));
  }
#endif
#undef QSPEC_DOT
#else
  int32_t word;
  std::memcpy(&word, w, 4);
  const __m256i b = _mm256_set1_epi32(word);
  for (int c = 0; c < N; ++c) s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(a[c], b));
#endif
}

// The 8-lane dot products.
struct Products : ProductsBase {
  using ProductsBase::ProductsBase;

  // A score tile's sc[i] = step_i (q_i . keys of the block kb), two dims a product, summed in
  // int32: q the tile's rows, from the head's row t0 (the keys: memory operands).
  template <int64_t D>
  void scores(const int16_t* q, int64_t t0, const int16_t* kb, vf (&sc)[ST][NV]) const {
    static_assert(NV == 4);
    __m256i s[ST][NV];
#pragma GCC unroll 8
    for (int i = 0; i < ST; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) s[i][c] = _mm256_setzero_si256();
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      const int16_t* kd = kb + d2 * KB * 2;  // [NV] x 8 keys x 2 dims
#pragma GCC unroll 8
      for (int i = 0; i < ST; ++i) dot_words(s[i], kd, q + i * D + 2 * d2);
    }
#pragma GCC unroll 8
    for (int i = 0; i < ST; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c)
        sc[i][c] = (vf)_mm256_mul_ps(_mm256_cvtepi32_ps(s[i][c]), _mm256_set1_ps(row_step[t0 + i]));
  }
  // Vectors c0 .. c0 + VC - 1 of a row group's sums: a[i][c] += p_{r0 + i} V[:, c0 + c] over
  // the block's nk keys, a pair of keys a product, summed in int32 and taken to fp32 with the
  // row's probability step, in units of the channels' value steps (`finish` applies them).
  template <int64_t D, int G, int VC>
  void value_columns(vf (&a)[G][VC], int64_t r0, int c0, int64_t nk, const int16_t* vb,
                     const float (*)[KB]) const {
    const int64_t pairs = (nk + 1) / 2;
    __m256i s[G][VC];
#pragma GCC unroll 8
    for (int i = 0; i < G; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < VC; ++c) s[i][c] = _mm256_setzero_si256();
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      __m256i vv[VC];
#pragma GCC unroll 8
      for (int c = 0; c < VC; ++c)
        vv[c] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(vb + (j2 * D + L * (c0 + c)) * 2));
#pragma GCC unroll 8
      for (int i = 0; i < G; ++i) dot_words(s[i], vv, pb[r0 + i] + 2 * j2);
    }
#pragma GCC unroll 8
    for (int i = 0; i < G; ++i) {
      const __m256 ps = _mm256_set1_ps(p_step[r0 + i]);
#pragma GCC unroll 8
      for (int c = 0; c < VC; ++c)
        a[i][c] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][c]), ps, (__m256)a[i][c]);
    }
  }
};
