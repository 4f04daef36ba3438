// The one Python module of qspec's CPU kernels (built by kernels/cpu/build.py).
#include <torch/extension.h>

#include "kernels.h"
#include "flash_prefill.h"  // (bf16::kAvailable)
#include "int_gemm.h"  // (kAvailable)
#include "isa.h"  // (simd::kVectorF8)

namespace py = pybind11;

void bind_decoder_stack(py::module& m);  // step.cpp

namespace {

// The caches' objects and steps (kv_cache.h), every field by name: what crosses the line
// between a cache (qspec_core/cache/) and the kernels.
void bind_kv_cache(py::module& m) {
  py::class_<HierStep>(m, "HierStep", "one forward over the hierarchical cache (kv_cache.h)")
      .def(py::init([](int64_t lo, int64_t n_fp, int64_t n_quant, at::Tensor n_quant_q,
                       at::Tensor shift, at::Tensor input_pos, bool int8, bool int_queries,
                       double softcap, c10::optional<at::Tensor> parents,
                       int64_t local_base) {
             TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
             TORCH_CHECK(local_base >= 0, "local_base must be >= 0");
             return HierStep{lo,      n_fp,          n_quant,       n_quant_q,
                             shift,   input_pos,     int8,          int_queries,
                             float(softcap), parents.value_or(at::Tensor()), local_base};
           }),
           py::kw_only(), py::arg("lo"), py::arg("n_fp"), py::arg("n_quant"),
           py::arg("n_quant_q"), py::arg("shift"), py::arg("input_pos"), py::arg("int8"),
           py::arg("int_queries"), py::arg("softcap") = 0.0, py::arg("parents") = py::none(),
           py::arg("local_base") = 0)
      .def_readonly("lo", &HierStep::lo)
      .def_readonly("n_fp", &HierStep::n_fp)
      .def_readonly("n_quant", &HierStep::n_quant)
      .def_readonly("n_quant_q", &HierStep::n_quant_q)
      .def_readonly("shift", &HierStep::shift)
      .def_readonly("input_pos", &HierStep::input_pos)
      .def_readonly("int8", &HierStep::int8)
      .def_readonly("int_queries", &HierStep::int_queries)
      .def_readonly("softcap", &HierStep::softcap)
      .def_readonly("parents", &HierStep::parents)
      .def_readonly("local_base", &HierStep::local_base);
  py::class_<HierKV>(m, "HierKV", "the hierarchical cache's buffers, all layers (kv_cache.h)")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                    std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>>(),
           py::kw_only(), py::arg("k_upper"), py::arg("k_lower"), py::arg("k_scale"),
           py::arg("k_zero"), py::arg("v_upper"), py::arg("v_lower"), py::arg("v_scale"),
           py::arg("v_zero"), py::arg("fp_k"), py::arg("fp_v"), py::arg("group_size"),
           py::arg("chunk"), py::arg("windows") = std::vector<int64_t>(),
           py::arg("local") = std::vector<at::Tensor>(), py::arg("slots") = std::vector<int64_t>())
      .def("write", &HierKV::write, py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("lo"))
      .def("attend", &HierKV::attend, py::arg("layer"), py::arg("q"), py::arg("step"))
      .def_property_readonly("group_size", &HierKV::group_size)
      .def_property_readonly("chunk", &HierKV::chunk);
  py::class_<FullStep>(m, "FullStep", "one forward over the full-precision cache (kv_cache.h)")
      .def(py::init([](int64_t start, int64_t end, c10::optional<at::Tensor> mask,
                       bool is_causal, int64_t local_start, c10::optional<at::Tensor> local_mask,
                       int64_t local_base) {
             return FullStep{start, end, mask, is_causal, local_start, local_mask, local_base};
           }),
           py::kw_only(), py::arg("start"), py::arg("end"), py::arg("mask"),
           py::arg("is_causal"), py::arg("local_start") = -1, py::arg("local_mask") = py::none(),
           py::arg("local_base") = 0)
      .def_readonly("start", &FullStep::start)
      .def_readonly("end", &FullStep::end)
      .def_readonly("mask", &FullStep::mask)
      .def_readonly("is_causal", &FullStep::is_causal)
      .def_readonly("local_start", &FullStep::local_start)
      .def_readonly("local_mask", &FullStep::local_mask)
      .def_readonly("local_base", &FullStep::local_base);
  py::class_<FullKV>(m, "FullKV", "the full-precision cache's k/v, all layers (kv_cache.h)")
      .def(py::init([](at::Tensor k, at::Tensor v, std::vector<int64_t> windows, double softcap,
                       c10::optional<at::Tensor> local_k, c10::optional<at::Tensor> local_v,
                       std::vector<int64_t> slots) {
             return FullKV(k, v, std::move(windows), softcap, local_k.value_or(at::Tensor()),
                           local_v.value_or(at::Tensor()), std::move(slots));
           }),
           py::kw_only(), py::arg("k"), py::arg("v"), py::arg("windows") = std::vector<int64_t>(),
           py::arg("softcap") = 0.0, py::arg("local_k") = py::none(),
           py::arg("local_v") = py::none(), py::arg("slots") = std::vector<int64_t>())
      .def("write", &FullKV::write, py::arg("layer"), py::arg("k"), py::arg("v"),
           py::arg("start"), py::arg("local_base") = 0)
      .def("attend", &FullKV::attend, py::arg("layer"), py::arg("q"), py::arg("step"));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention_cpu", &prefill_attention_cpu, "tiled causal prefill attention (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("start"),
        py::arg("products") = "fp32", py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.attr("PREFILL_BF16") = flash::bf16::kAvailable;  // whether the bf16 products exist
  m.attr("PREFILL_INT16") = flash::int16::kAvailable;  // whether the int16 products exist
  // keys a prefill block folds (its probabilities' steps are per block: the twins' blocks)
  m.attr("PREFILL_KEY_BLOCK") = flash::KB;
  m.def("dequantize_planes_cpu", &dequantize_planes_cpu, "KV planes -> fp32 rows (CPU)");
  m.def("linear_rows_cpu", &linear_rows_cpu, "x W^T + b for a step's rows (CPU, fp32 x)");
  // whether bf16 weights give their fp32 upcast's bits on the row kernels (vector builds; the
  // portable loop may vectorize each weight type its own way; the K % 8 scalar tail is
  // compiled per weight type under -ffast-math too: the tests hold it bit for bit, K = 100)
  m.attr("BF16_WEIGHT_ROWS") = simd::kVectorF8;
  m.def("int8_rows_cpu", &int8_rows_cpu, "x (s q)^T + b, int8 weights, fp32 x (CPU)");
  m.attr("MAX_STEP_ROWS") = kMaxStepRows;
  // whether a prefill's W8A8 rows sum each chunk in one lane (int_gemm.h), not as a step does
  m.attr("W8A8_PREFILL_LANES") = intgemm::kAvailable;
  m.def("w8a8_rows_cpu", &w8a8_rows_cpu, "x (s q)^T + b, int8 weights, x rounded to int8 (CPU)");
  m.def("w8a8_prefill_cpu", &w8a8_prefill_cpu,
        "[x (s q)^T + b for each weight]: a prefill's rows rounded to int8 once (CPU)");
  m.def("int4_rows_cpu", &int4_rows_cpu, "4-bit weights x int8-quantized rows (CPU, W4A8)");
  m.def("rms_norm_cpu", &rms_norm_cpu, "RMSNorm over the last dim (CPU, fp32)");
  m.def("add_rms_norm_cpu", &add_rms_norm_cpu, "x += h in place, then RMSNorm (CPU, fp32)");
  m.def("rope_cpu", &rope_cpu, "rotate-half RoPE in place on [B, T, n, D] (CPU, fp32)");
  bind_kv_cache(m);  // (before the stack, whose `run` takes them)
  bind_decoder_stack(m);
}
