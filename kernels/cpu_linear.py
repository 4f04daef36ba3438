"""The few-row fp32 linear of a decode or verify step on CPU: `cpu_linear.cpp`.

`linear(x, weight, bias)` equals `F.linear` (its twin, which the tests compare it against)
to rounding. It serves inputs of at most `MAX_ROWS` rows (a draft step's 1, a verify's
gamma + 1) in fp32 with a contiguous weight; `usable` says when, else callers use F.linear.
"""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.w4a16 import unpack_int4

MAX_ROWS = 8


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and x.numel() <= MAX_ROWS * weight.shape[1]
        and cpu_ext.available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias -> [..., N], for at most MAX_ROWS rows of x."""
    module = cpu_ext.load()
    if module is None:
        raise RuntimeError(f"CPU linear kernel unavailable: {cpu_ext.failure()}")
    rows = x.reshape(-1, x.shape[-1])
    return module.linear_rows_cpu(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------ the draft's 4-bit linear
CHUNK = 64  # inputs per int8 activation step (and the weight groups' granularity)


def int4_usable(x: torch.Tensor, in_features: int, group_size: int) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and in_features % CHUNK == 0
        and group_size % CHUNK == 0
        and x.numel() <= MAX_ROWS * in_features
        and cpu_ext.available()
    )


def int4_linear(x, packed, scale, zero, group_size: int, bias=None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) through 4-bit weights (packed [N, K/2], scale/zero
    [N, K/G], w = (q - zero) * scale) with x rounded to int8 per 64 inputs (W4A8)."""
    module = cpu_ext.load()
    if module is None:
        raise RuntimeError(f"CPU linear kernel unavailable: {cpu_ext.failure()}")
    rows = x.reshape(-1, x.shape[-1])
    out = module.int4_rows_cpu(rows, packed, scale, zero, group_size, bias)
    return out.view(*x.shape[:-1], packed.shape[0])


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations `int4_linear` multiplies: x rounded to int8 per 64 inputs (symmetric,
    step max|x| / 127, ties to even), returned dequantized, fp32."""
    chunks = x.float().reshape(*x.shape[:-1], -1, CHUNK)
    amax = chunks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(chunks * inv)
    return (codes * (amax / 127.0)).reshape(x.shape)


def int4_linear_ref(x, packed, scale, zero, group_size: int, bias=None) -> torch.Tensor:
    """`int4_linear`'s twin: the same activation rounding, then a dense fp32 matmul."""
    from qspec_core.quant_linear import dequantize

    w = dequantize(unpack_int4(packed), scale, zero)
    return torch.nn.functional.linear(quantize_activations(x), w, bias)
