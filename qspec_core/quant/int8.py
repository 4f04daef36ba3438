"""W8A16 linear layers for an INT8-weight target: per-output-channel symmetric int8 weights.

    W[n, k] = weight_int8[n, k] * weight_scale[n],  weight_int8 in -127..127

What target this gives. A model whose linears are `Int8Linear` defines the INT8-weight target
distribution: the logits of the dense model with every weight replaced by its dequantized
value `dequantized_weight()` (round-to-nearest on a per-row grid of step max|W_row| / 127,
so |W - W_int8| <= step / 2). The speculative verifier samples from that distribution, not
from the bf16/fp32 checkpoint's: drafts are accepted against the INT8 target, and greedy
output matches greedy decoding of the INT8 model, which is close to, but not bit-equal to,
the full-precision model's.

Storage (a plain `state_dict`, safetensors-friendly): `weight_int8` int8 [N, K],
`weight_scale` fp32 [N], and `bias` fp32 [N] when the layer has one. Nothing else is
persistent, so `safetensors.torch.save_file(layer.state_dict(), path)` and
`layer.load_state_dict(load_file(path))` round-trip a layer exactly.

Forward paths:

- CUDA: the Triton kernel `kernels.triton.w8a16.w8a16_matmul` (fp32 accumulation, x.dtype out).
- CPU, a decode or verify step (at most `kernels.MAX_STEP_ROWS` rows), chosen by the
  CPU runner (`qspec_core/runner/cpu.py`), not here: qspec's C++ kernel
  `kernels.cpu.linear.int8_linear`: fp32 activations, fp32 accumulation of x q in a fixed
  order, then the scale and bias; batch-invariant (a row's result does not depend on how many
  rows share the call), so a verify's target logits are bit for bit those of target-ar. Its
  error against dequantize-then-fp32-matmul is fp32 rounding only.
- CPU, more rows (prefill; the same for every mode): PyTorch's int8 weight kernel
  `torch._weight_int8pack_mm`, which is fast only with bf16 activations. x is cast to bf16,
  the kernel accumulates sum_k x[m, k] * q[n, k] in fp32 and returns it rounded to bf16; the
  fp32 scale and bias are applied afterwards in fp32, and the result is cast to x.dtype. The
  outputs therefore differ from dequantize-then-fp32-matmul by
  the bf16 rounding (relative 2^-9 each) of the activations and of the unscaled sum:
  elementwise, with W the dequantized weight,
      fp32 x:  |y_cpu - y_ref| <= 2^-8 * (|x| @ |W|^T)       (+ fp32 noise)
      bf16 x:  |y_cpu - y_ref| <= 3 * 2^-9 * (|x| @ |W|^T)   (x exact; both outputs rounded
                                                               to bf16, the sum once more)
  which tests/test_w8a16.py asserts. The scale is passed to the kernel as a constant bf16
  vector of ones and applied in fp32 afterwards, because the kernel reads scales in the
  activation dtype: bf16 scales would add a fixed per-channel error of up to 2^-9 (a bias
  repeated on every token) on top of the rounding noise.
  This is the layer's own forward; which product a runner's prefill takes instead (qspec's
  row kernels, or the fp32 path below: W dequantized, fp32 GEMM, fp32 rounding only) is the
  runner's choice, measured once per machine (`qspec_core/runner/kernel_table.py`).
- Anything else (other devices, shapes the CPU kernel cannot take, torch builds without the
  op): `kernels.triton.w8a16.w8a16_ref`, dequantize-then-fp32-matmul.

CPU kernel constraints (torch 2.13, read from its AVX2/AVX-512 code and checked here): it
loads activation rows with *aligned* 16-byte (AVX2) or 32-byte (AVX-512) vector loads in steps
of 8 or 16 elements, so K must be a multiple of 16 and each row 32-byte aligned. Otherwise it
reads past the row (garbage results when M = 1) or faults (segfault when M > 1 or when x is a
view at an odd offset). It also rejects fp32 scales with bf16 activations. `cpu_kernel_ok`
and `_cpu_forward` enforce all of this before calling it.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.formats import dequantize_int8, quantize_int8
from kernels.triton.w8a16 import w8a16_matmul, w8a16_ref
from qspec_core.quant import filled

# torch._weight_int8pack_mm walks K in vector steps of 8 (AVX2) or 16 (AVX-512) bf16 values.
CPU_K_MULTIPLE = 16
# Aligned vector loads need 32-byte rows on AVX-512; the CPU allocator gives 64, ask for that.
CPU_ALIGNMENT = 64
_HAS_CPU_OP = hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """A linear layer whose weight is per-channel INT8 (W8A16).

    Buffers: weight_int8 int8 [N, K], weight_scale fp32 [N], bias fp32 [N] or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8)
        )
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # The CPU kernel's scale operand: ones in bf16 [N], so it returns the unscaled sum and
        # the exact fp32 scale is applied after. Constant, so it never goes stale when
        # weight_scale is loaded; not persistent, so it stays out of the state_dict.
        self.register_buffer(
            "_unit_scale", torch.ones(out_features, dtype=torch.bfloat16), persistent=False
        )

    @classmethod
    def from_quantized(
        cls, w_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        """From int8 [N, K] weights and their fp32 scale [N] (and an optional bias [N])."""
        N, K = w_int8.shape
        return filled(cls(K, N, bias is not None), bias, weight_int8=w_int8, weight_scale=scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Round-to-nearest per-channel INT8 quantization of an existing linear layer."""
        w_int8, scale = quantize_int8(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data.float()
        return cls.from_quantized(w_int8, scale, bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The dense fp32 weight [N, K] this layer represents (for reports and tests)."""
        return dequantize_int8(self.weight_int8, self.weight_scale)

    def cpu_kernel_ok(self) -> bool:
        """Whether the weights fit torch's CPU int8 kernel (K multiple of 16, int8 [N, K]
        contiguous and aligned, since AVX-512 loads weight rows with aligned loads too)."""
        weight = self.weight_int8  # one nn.Module attribute lookup: this runs on every call
        return (
            _HAS_CPU_OP
            and self.in_features % CPU_K_MULTIPLE == 0
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and weight.data_ptr() % CPU_ALIGNMENT == 0
        )

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., K] on CPU -> y [..., N] via the int8 kernel, or None if it cannot run."""
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K] bf16
        if x2.shape[0] == 0:
            return None
        if x2.data_ptr() % CPU_ALIGNMENT:
            x2 = x2.clone()  # a bf16 view at an odd offset: a fresh allocation is aligned
        try:
            # [M, N] bf16: sum_k x[m, k] * q[n, k], accumulated in fp32, rounded once
            acc = torch._weight_int8pack_mm(x2, self.weight_int8, self._unit_scale)
        except RuntimeError:
            return None
        # bf16 [M, N] times fp32 [N] promotes to fp32: scale (and bias) in one fp32 op
        if self.bias is None:
            y = torch.mul(acc, self.weight_scale)
        else:
            y = torch.addcmul(self.bias, acc, self.weight_scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return w8a16_matmul(x, self.weight_int8, self.weight_scale, self.bias)
        if x.device.type == "cpu" and self.cpu_kernel_ok():
            y = self._cpu_forward(x)
            if y is not None:
                return y
        return w8a16_ref(x, self.weight_int8, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
