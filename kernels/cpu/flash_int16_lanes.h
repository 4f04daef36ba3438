// The vector operations flash_int16.h's roundings and layouts need, one register wide: 16 fp32
// or int32 lanes with AVX-512, 8 with AVX2. Each is the same arithmetic on every width (the
// codes: x * inv rounded to nearest even, as torch.round, then clamped), so the roundings
// are written once, in flash_int16.h.
//
// Included by flash_int16.h inside namespace flash::int16.

#if defined(QSPEC_AVX512_VNNI)
struct Lanes {
  static constexpr int N = 16;
  using F = __m512;
  using I = __m512i;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static I zero() { return _mm512_setzero_si512(); }
  // codes of x * inv, clamped to -levels..levels
  static I codes(F x, F inv, int levels) {
    const I c = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
    return _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(levels)),
                            _mm512_set1_epi32(-levels));
  }
  static void store_codes(int16_t* out, I c) {  // N int16, in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(c));
  }
  static void store_words(int16_t* out, I a, I b) {  // N words: a's code low, b's high
    _mm512_storeu_si512(out, _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)),
                                             _mm512_slli_epi32(b, 16)));
  }
  // The largest |x| of each lane over v's, a NaN kept (vmaxps returns its second operand
  // where either is a NaN, so a NaN would be dropped by the next finite value).
  struct AbsMax {
    F m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    void add(F v) {
      m = _mm512_max_ps(m, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    void get(float* lanes) const {
      _mm512_storeu_ps(lanes, _mm512_mask_mov_ps(m, nan, set1(quiet_nan())));
    }
    float top() const { return nan ? quiet_nan() : _mm512_reduce_max_ps(m); }
  };
  static float quiet_nan() { return std::numeric_limits<float>::quiet_NaN(); }
};
#else  // AVX2 (and AVX-VNNI)
struct Lanes {
  static constexpr int N = 8;
  using F = __m256;
  using I = __m256i;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static I zero() { return _mm256_setzero_si256(); }
  static I codes(F x, F inv, int levels) {
    const I c = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
    return _mm256_max_epi32(_mm256_min_epi32(c, _mm256_set1_epi32(levels)),
                            _mm256_set1_epi32(-levels));
  }
  // (vpackssdw packs per 128-bit half: the permute puts the halves' codes in order; the codes
  // are within int16, so its saturation never acts)
  static void store_codes(int16_t* out, I c) {
    const I packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c, c), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }
  static void store_words(int16_t* out, I a, I b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)),
                                        _mm256_slli_epi32(b, 16)));
  }
  struct AbsMax {
    F m = _mm256_setzero_ps();
    F nan = _mm256_setzero_ps();  // (all-ones lanes where a NaN came)
    void add(F v) {
      m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    void get(float* lanes) const {
      _mm256_storeu_ps(lanes, _mm256_blendv_ps(m, set1(quiet_nan()), nan));
    }
    float top() const {
      if (_mm256_movemask_ps(nan)) return quiet_nan();
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      return *std::max_element(lanes, lanes + 8);
    }
  };
  static float quiet_nan() { return std::numeric_limits<float>::quiet_NaN(); }
};
#endif
