// The C++ CPU kernels' entry points, shared by the bindings (module.cpp) and the one-call
// decode step (step.cpp). Shapes and contracts are at each definition.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "isa.h"
#include "kv_cache.h"

// hier_attention.cpp: hier_attention_cpu, over the named layer and step of kv_cache.h
// flash_prefill.cpp
at::Tensor prefill_attention_cpu(at::Tensor q, at::Tensor k, at::Tensor v, int64_t start,
                                 const std::string& products, int64_t window,
                                 double softcap);
// dequant.cpp
void dequantize_planes_cpu(at::Tensor upper, at::Tensor lower, at::Tensor scale,
                           at::Tensor zero, int64_t group_size, bool per_channel, bool int8,
                           at::Tensor out);
// linear.cpp
// The most rows a decode or verify step hands the few-row kernels: gamma + 1, from the one
// definition in Python (kernels/__init__.py's MAX_STEP_ROWS), which the build passes
#ifndef QSPEC_MAX_STEP_ROWS
#error "QSPEC_MAX_STEP_ROWS undefined: build with kernels/cpu/build.py's compile_flags()"
#endif
constexpr int64_t kMaxStepRows = QSPEC_MAX_STEP_ROWS;
at::Tensor linear_rows_cpu(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> b);
at::Tensor int8_rows_cpu(at::Tensor x, at::Tensor w, at::Tensor scale,
                            c10::optional<at::Tensor> b);
// int_dot.cpp
at::Tensor w8a8_rows_cpu(at::Tensor x, at::Tensor w, at::Tensor scale,
                            c10::optional<at::Tensor> b);
// several weights of one x [M, K], M > kMaxStepRows (a prefill), in one call: on x86 (AVX2,
// AVX-VNNI, AVX-512 VNNI) x rounded once and one parallel region (int_gemm.h), else one
// product after another
std::vector<at::Tensor> w8a8_prefill_cpu(at::Tensor x, std::vector<at::Tensor> ws,
                                         std::vector<at::Tensor> scales,
                                         std::vector<c10::optional<at::Tensor>> biases);
at::Tensor int4_rows_cpu(at::Tensor x, at::Tensor packed, at::Tensor scale,
                            at::Tensor zero, int64_t group_size, c10::optional<at::Tensor> b);
// decode.cpp
at::Tensor rms_norm_cpu(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm_cpu(at::Tensor x, at::Tensor h, at::Tensor w, double eps);
void rope_cpu(at::Tensor x, at::Tensor cos, at::Tensor sin);
