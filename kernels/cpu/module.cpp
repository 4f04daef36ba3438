// The one Python module of qspec's CPU kernels (built by kernels/cpu/build.py).
#include <torch/extension.h>

#include "kernels.h"

void bind_decoder_stack(pybind11::module& m);  // step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hier_attention_cpu", &hier_attention_cpu, "hierarchical KV attention (CPU)");
  m.def("prefill_attention_cpu", &prefill_attention_cpu, "tiled causal prefill attention (CPU)");
  m.def("dequantize_planes_cpu", &dequantize_planes_cpu, "KV planes -> fp32 rows (CPU)");
  m.def("linear_rows_cpu", &linear_rows_cpu, "x W^T + b for a step's rows (CPU, fp32 x)");
  m.def("int8_rows_cpu", &int8_rows_cpu, "x (s q)^T + b, int8 weights, fp32 x (CPU)");
  m.attr("MAX_STEP_ROWS") = kMaxStepRows;
  m.def("w8a8_rows_cpu", &w8a8_rows_cpu, "x (s q)^T + b, int8 weights, x rounded to int8 (CPU)");
  m.def("int4_rows_cpu", &int4_rows_cpu, "4-bit weights x int8-quantized rows (CPU, W4A8)");
  m.def("rms_norm_cpu", &rms_norm_cpu, "RMSNorm over the last dim (CPU, fp32)");
  m.def("add_rms_norm_cpu", &add_rms_norm_cpu, "x += h in place, then RMSNorm (CPU, fp32)");
  m.def("rope_cpu", &rope_cpu, "rotate-half RoPE in place on [B, T, n, D] (CPU, fp32)");
  bind_decoder_stack(m);
}
