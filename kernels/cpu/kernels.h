// The C++ CPU kernels' entry points, shared by the bindings (module.cpp) and the one-call
// decode step (step.cpp). Shapes and contracts are at each definition.
#pragma once
#include <torch/extension.h>

#include "isa.h"

// hier_attention.cpp
torch::Tensor hier_attention_cpu(torch::Tensor q, torch::Tensor k_upper, torch::Tensor k_lower,
                                 torch::Tensor k_scale, torch::Tensor k_zero,
                                 torch::Tensor v_upper, torch::Tensor v_lower,
                                 torch::Tensor v_scale, torch::Tensor v_zero,
                                 torch::Tensor n_quant_q, torch::Tensor fp_k, torch::Tensor fp_v,
                                 int64_t fp_pos0, torch::Tensor fp_lo, torch::Tensor input_pos,
                                 bool target, bool int_queries, int64_t group_size,
                                 int64_t chunk);
// linear.cpp
// The most rows a decode or verify step hands the few-row kernels: gamma + 1 for gamma <= 16.
constexpr int64_t kMaxStepRows = 17;
torch::Tensor linear_rows_cpu(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b);
torch::Tensor int8_rows_cpu(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                            c10::optional<torch::Tensor> b);
// int_dot.cpp
torch::Tensor w8a8_rows_cpu(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                            c10::optional<torch::Tensor> b);
torch::Tensor int4_rows_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                            torch::Tensor zero, int64_t group_size, c10::optional<torch::Tensor> b);
// decode.cpp
torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_cpu(torch::Tensor x, torch::Tensor h, torch::Tensor w, double eps);
void rope_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
// step.cpp
void bind_decoder_stack(pybind11::module& m);
