"""W8A16 matmul: activations in bf16/fp16/fp32 times per-output-channel symmetric INT8 weights.

    y[M, N] = x[M, K] @ W^T + bias,   W[n, k] = q[n, k] * scale[n],  q in -127..127

Layout (what `kernels.formats.quantize_int8` returns and `Int8Linear` stores):

- `w_int8` int8 [N, K], row-major, any K and N.
- `scale` [N] fp32: max |W[n, :]| / 127, so every row uses the full symmetric grid; -128 is
  never produced, which keeps the grid symmetric around 0 (|q| <= 127 for every entry).
- `bias` [N] or None.

`w8a16_ref` is the pure-PyTorch twin (dequantize, then matmul in fp32); `w8a16_matmul` is
the public entry point, which runs the Triton kernel (`kernels.triton.jit.w8a16`, imported
only then) on CUDA tensors (or on CPU under `TRITON_INTERPRET=1`) and the twin everywhere
else.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.formats import dequantize_int8
from kernels.triton.runs import kernel_runs_on

# ---------------------------------------------------------------------------------------------
# The pure-PyTorch twin


def _check(x, w_int8, scale, bias) -> tuple[int, int]:
    """Validate the operands; return (N, K)."""
    if w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        raise ValueError(f"w_int8 must be int8 [N, K], got {w_int8.dtype} {tuple(w_int8.shape)}")
    n, k = w_int8.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K = {x.shape[-1]}, w_int8 holds K = {k}")
    if tuple(scale.shape) != (n,):
        raise ValueError(f"scale must be [{n}], got {list(scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {list(bias.shape)}")
    return n, k


def w8a16_ref(
    x: torch.Tensor,
    w_int8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference W8A16 matmul: x [..., K] -> y [..., N] in x.dtype (dequantize, dot in fp32)."""
    _check(x, w_int8, scale, bias)
    y = x.float() @ dequantize_int8(w_int8, scale).T  # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The kernel's launch (`kernels.triton.jit.w8a16`) and the public wrapper


def _jit() -> ModuleType:
    """The kernel's module, imported (with Triton) on first use."""
    from kernels.triton.jit import w8a16

    return w8a16


def _launch(
    x: torch.Tensor,
    w_int8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the Triton kernel on x [..., K] -> y [..., N] (no fallback: the caller chose Triton)."""
    _check(x, w_int8, scale, bias)
    return _jit().launch(x, w_int8, scale, bias)


def triton_usable(x: torch.Tensor) -> bool:
    """Whether `w8a16_matmul` runs the Triton kernel for x (`kernel_runs_on`: on CUDA, or on
    CPU in the interpreter)."""
    return kernel_runs_on(_jit, x)


def w8a16_matmul(
    x: torch.Tensor,
    w_int8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (w_int8 * scale[:, None])^T + bias, in x.dtype.

    Runs the Triton kernel where it can run (`triton_usable`), else the PyTorch twin.
    """
    if triton_usable(x):
        return _launch(x, w_int8, scale, bias)
    return w8a16_ref(x, w_int8, scale, bias)
