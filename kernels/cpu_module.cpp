// The one Python module of qspec's CPU kernels (built by kernels/cpu_ext.py).
#include <torch/extension.h>

torch::Tensor hier_attention_cpu(torch::Tensor q, torch::Tensor k_upper, torch::Tensor k_lower,
                                 torch::Tensor k_scale, torch::Tensor k_zero,
                                 torch::Tensor v_upper, torch::Tensor v_lower,
                                 torch::Tensor v_scale, torch::Tensor v_zero,
                                 torch::Tensor n_quant_q, torch::Tensor fp_k, torch::Tensor fp_v,
                                 int64_t fp_pos0, torch::Tensor fp_lo, torch::Tensor input_pos,
                                 bool target, int64_t group_size, int64_t chunk);
torch::Tensor linear_rows_cpu(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b);
torch::Tensor int4_rows_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                            torch::Tensor zero, int64_t group_size, c10::optional<torch::Tensor> b);
torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_cpu(torch::Tensor x, torch::Tensor h, torch::Tensor w, double eps);
void rope_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor int4_linear_cpu(torch::Tensor x, torch::Tensor pack, torch::Tensor scale_zero,
                              int64_t group_size, int64_t n_out);
void bind_decoder_stack(pybind11::module& m);  // cpu_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hier_attention_cpu", &hier_attention_cpu, "hierarchical KV attention (CPU)");
  m.def("linear_rows_cpu", &linear_rows_cpu, "x W^T + b for at most 8 rows of x (CPU, fp32)");
  m.def("int4_rows_cpu", &int4_rows_cpu, "4-bit weights x int8-quantized rows (CPU, W4A8)");
  m.def("rms_norm_cpu", &rms_norm_cpu, "RMSNorm over the last dim (CPU, fp32)");
  m.def("add_rms_norm_cpu", &add_rms_norm_cpu, "x += h in place, then RMSNorm (CPU, fp32)");
  m.def("rope_cpu", &rope_cpu, "rotate-half RoPE in place on [B, T, n, D] (CPU, fp32)");
  m.def("int4_linear_cpu", &int4_linear_cpu, "int4 weight matmul on fp32 input (CPU)");
  bind_decoder_stack(m);
}
