"""W4A16 matmul: activations in bf16/fp16/fp32 times 4-bit group-quantized weights.

    y[M, N] = x[M, K] @ W^T,   W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Runtime layout (produced by the weight converter, consumed here):

- `packed` uint8 [N, K // 2]: two nibbles per byte along K; element k = 2i sits in the LOW
  nibble of byte i, k = 2i + 1 in the HIGH nibble (`kernels.formats.pack_int4` / `unpack_int4`).
- `scale`, `zero` [N, K // G] in the activation dtype or fp32; `zero` is a float zero point
  (may be fractional), q in 0..15.
- K % G == 0, any N; the kernel takes G in {32, 64, 128, 256}, the twin any G (a layer whose
  G does not divide its inputs is stored and fed padded to whole groups, `quant/int4.py`).

`w4a16_ref` is the pure-PyTorch twin; `w4a16_matmul` is the public entry point, which runs
the Triton kernel (`kernels.triton.jit.w4a16`, imported only then) on CUDA tensors (or on
CPU under `TRITON_INTERPRET=1`) and the twin everywhere else.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.formats import unpack_int4
from kernels.triton.runs import kernel_runs_on

GROUP_SIZES = (32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------
# The pure-PyTorch twin


def _check(x, packed, scale, zero, group_size) -> tuple[int, int]:
    """Validate the operands; return (N, K)."""
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K // 2], got {packed.dtype}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"x has K = {x.shape[-1]}, packed holds K = {k}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size = {group_size}")
    groups = (n, k // group_size)
    if tuple(scale.shape) != groups or tuple(zero.shape) != groups:
        raise ValueError(
            f"scale/zero must be {list(groups)}, got {list(scale.shape)} / {list(zero.shape)}"
        )
    return n, k


def w4a16_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Reference W4A16 matmul: x [..., K] -> y [..., N] in x.dtype (dequantize and dot in fp32)."""
    _check(x, packed, scale, zero, group_size)
    q = unpack_int4(packed).float()  # [N, K]
    scale_k = scale.float().repeat_interleave(group_size, dim=1)  # [N, K]
    zero_k = zero.float().repeat_interleave(group_size, dim=1)  # [N, K]
    weight = (q - zero_k) * scale_k  # [N, K]
    return (x.float() @ weight.T).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The kernel's launch (`kernels.triton.jit.w4a16`) and the public wrapper


def _jit() -> ModuleType:
    """The kernel's module, imported (with Triton) on first use."""
    from kernels.triton.jit import w4a16

    return w4a16


def _launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Run the Triton kernel on x [..., K] -> y [..., N] (no fallback: the caller chose Triton)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    _check(x, packed, scale, zero, group_size)
    return _jit().launch(x, packed, scale, zero, group_size)


def triton_usable(x: torch.Tensor) -> bool:
    """Whether `w4a16_matmul` runs the Triton kernel for x (`kernel_runs_on`: on CUDA, or on
    CPU in the interpreter)."""
    return kernel_runs_on(_jit, x)


def w4a16_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(packed, scale, zero)^T, in x.dtype.

    Runs the Triton kernel where it can run (`triton_usable`, a group size it takes), else
    the PyTorch twin.
    """
    if triton_usable(x) and group_size in GROUP_SIZES:
        return _launch(x, packed, scale, zero, group_size)
    return w4a16_ref(x, packed, scale, zero, group_size)
