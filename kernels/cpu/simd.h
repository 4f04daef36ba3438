// The SIMD layer: the few vector types and operations the kernels need, one file per
// instruction set, so that a kernel is written once and an ISA is added by adding a file.
//
//   simd_avx2.h      x86-64 with AVX2, FMA and F16C (and AVX-VNNI's 256-bit vpdpbusd)
//   simd_avx512.h    the above plus AVX-512 F/BW/DQ/VL/VNNI (512-bit vpdpbusd)
//   simd_neon.h      aarch64 NEON (sdot with the dotprod extension)
//   simd_portable.h  plain C++: what a build without any of those runs
//
// Every file defines, in namespace simd:
//   F8     eight fp32 lanes: zero8, load8 (fp32, int8, bf16, fp16 in memory), store8, fma
//          (a * b + c, fused where the ISA has it), hsum (one fixed order, the same on every ISA
//          that has F8 in registers: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)));
//   Dot64  the integer dot of 64 int8 weights with 64 int8 activation codes, landing in float
//          lanes (Dot64::Acc) that a chunk's step scales and that Dot64::sum reduces in one
//          fixed order (16 lanes on AVX-512, the F8 order elsewhere); `nr<M>()`: how many
//          weight rows a pass takes against M activation rows (the registers it has).
//   Int4   the W4A8 draft's dot (int4_dot.h): 32 packed nibble bytes against a chunk's even and
//          odd int8 codes per step of kChunks chunks (two on AVX-512), acc += (dot * step) * scale
//          in float lanes (the portable file: acc + dot * scale * step, its own bits), sum, nr<M>;
//   Codes  the activations' rounding's vector pass (isa.h's round_to_codes): abs_max and round
//          over a prefix of x, returning how much they did (0: the scalar loop does all);
//   Attn   the attention's vector ops (attention_math.h, attention_int.h, hier_attention.cpp):
//          kVector (false on NEON and portable builds, which run the portable attention kernels),
//          dot_prefix (a prefix of a fixed-order dot), and where kVector: Scores and Fold (fp32
//          lanes with set/load/store/add/sub/mul/max/fma, exp (Cephes), sum, max_of; sums8 on
//          Scores: eight vectors' sums at once), decode_segment / segment_words /
//          deinterleave_segment (a 64-dim segment into the kernel's deinterleaved order, as
//          floats or int16), row_dots<DT> (int16 dots of a row against kDotTokens tokens).
// The order of every reduction is part of a kernel's numerics: a row's bits must not depend
// on how many rows share a call (batch invariance), so each file fixes its order once here.
//
// The QSPEC_* macros name the paths this build compiles (QSPEC_AVX2, QSPEC_AVX512_VNNI,
// QSPEC_AVX_VNNI, QSPEC_NEON, QSPEC_NEON_DOTPROD): the ISA files test them (the kernels
// do not: flash_prefill.h aside, they are written on this layer alone).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QSPEC_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QSPEC_AVX512_VNNI 1
#include "simd_avx512.h"
#else
#if defined(__AVXVNNI__)
#define QSPEC_AVX_VNNI 1  // the 256-bit vpdpbusd (AVX-VNNI)
#endif
#include "simd_avx2.h"
namespace simd {
using Dot64 = Dot64Avx2;
using Codes = CodesScalar;
using Int4 = Int4Avx2;
using Attn = AttnAvx2;
}
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define QSPEC_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define QSPEC_NEON_DOTPROD 1  // sdot (Armv8.2-A dotprod: Graviton 2+, Apple M1+)
#endif
#include "simd_neon.h"
#else
#include "simd_portable.h"
#endif
