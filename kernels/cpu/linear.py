"""The few-row linears of a decode or verify step on CPU: `linear.cpp`, `int_dot.cpp`.

`linear(x, weight, bias)` equals `F.linear` (its twin, which the tests compare it against)
to rounding; `int8_linear(x, q, scale, bias)` equals `kernels.formats.dequantize_int8` then
`F.linear` to rounding; `w8a8_linear` the same with the activations rounded to int8 per 64
inputs first (`w8a8_linear_ref`, its twin). All serve inputs of at most `MAX_STEP_ROWS`
rows (`kernels/__init__.py`: a draft step's 1, a verify's gamma + 1) and are
**batch-invariant**: a row's result does not depend on how many rows share the call, so a
token's target logits inside a verify are bit for bit those of the same token decoded alone
(what greedy QuantSpec == target-ar rests on). Activations of any float dtype are upcast to
fp32 exactly; the result is cast back. `usable` / `int8_usable` / `w8a8_usable` say when they
apply, else callers use PyTorch.
"""

from __future__ import annotations

import torch

from kernels import MAX_STEP_ROWS
from kernels.cpu import build as cpu_ext
from kernels.formats import (
    ACT_CHUNK,
    dequantize_int4,
    quantize_activations,
    round_symmetric,
    unpack_int4,
)

INT4_MAX_ROWS = 8  # the draft's W4A8 kernel: draft steps are one token
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in FLOATS
        and weight.dtype in FLOATS
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and 1 <= rows(x) <= MAX_STEP_ROWS
        and cpu_ext.available()
    )


def _module():
    module = cpu_ext.load()
    if module is None:
        raise RuntimeError(f"CPU linear kernel unavailable: {cpu_ext.failure()}")
    return module


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias -> [..., N] in x.dtype, at most MAX_STEP_ROWS rows."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = _module().linear_rows_cpu(flat, weight, bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def int8_weight_ok(weight_int8: torch.Tensor) -> bool:
    """Whether `int8_linear` takes these weights (CPU, int8 [N, K] contiguous)."""
    w = weight_int8
    return w.device.type == "cpu" and w.dtype == torch.int8 and w.is_contiguous()


def int8_usable(x: torch.Tensor, weight_int8: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in FLOATS
        and int8_weight_ok(weight_int8)
        and 1 <= rows(x) <= MAX_STEP_ROWS
        and cpu_ext.available()
    )


def int8_linear(x, weight_int8, scale, bias=None) -> torch.Tensor:
    """x [..., K] through int8 weights [N, K] with an fp32 scale per row (W = q * scale):
    fp32 accumulation of x q, then scale and bias, in x.dtype, at most MAX_STEP_ROWS rows."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = _module().int8_rows_cpu(flat, weight_int8, scale, bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight_int8.shape[0])


# ------------------------------------------------------------- int8 activations (int_dot.cpp)
CHUNK = ACT_CHUNK  # inputs per int8 activation step (and the weight groups' granularity)


def w8a8_usable(x: torch.Tensor, weight_int8: torch.Tensor) -> bool:
    return int8_usable(x, weight_int8) and weight_int8.shape[-1] % CHUNK == 0


def w8a8_linear(x, weight_int8, scale, bias=None) -> torch.Tensor:
    """x [..., K] (K % 64 == 0) rounded to int8 per 64 inputs, through int8 weights [N, K] with
    an fp32 scale per row: integer dot products per 64 inputs, summed with the activations'
    steps, then scale and bias; in x.dtype. Batch-invariant. Any number of rows: beyond
    MAX_STEP_ROWS (a prefill) the C++ runs `int_gemm.h`: on x86 (AVX2, AVX-VNNI, AVX-512
    VNNI) a GEMM that sums each chunk in one lane (`w8a8_prefill_ref` bit for bit: a decode
    step's result to fp32 rounding, itself batch-invariant), else the step's blocks on a GEMM
    schedule (a decode step's bits); `prefill_lanes()` says which (`w8a8_usable` checks a
    step's size; callers check a prefill's on one of its rows)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = _module().w8a8_rows_cpu(flat, weight_int8, scale, bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight_int8.shape[0])


def w8a8_prefill(x: torch.Tensor, weights: list[tuple]) -> list[torch.Tensor]:
    """[`w8a8_linear(x, *w)` for w in weights] (each (weight_int8, scale, bias)) for a
    prefill's x [..., K] of more than MAX_STEP_ROWS rows, in one call (a layer's q, k, v; gate,
    up): on x86 x rounded once and every product in one parallel region, elsewhere one product
    after another. Each output bit for bit as `w8a8_linear` makes it alone."""
    flat = x.reshape(-1, x.shape[-1]).float()
    ws, scales, biases = zip(*weights, strict=True)
    outs = _module().w8a8_prefill_cpu(flat, list(ws), list(scales), list(biases))
    return [o.to(x.dtype).view(*x.shape[:-1], o.shape[-1]) for o in outs]


SLICE_ROWS = 16  # a prefill's rows per row-kernel call (`in_slices`)


def in_slices(run, x: torch.Tensor, weight_int8: torch.Tensor, *args) -> torch.Tensor:
    """`run(x_slice, weight_int8, *args)` (`int8_linear`) over x [..., K] `SLICE_ROWS` rows
    at a time: a W8A16 prefill through the step kernels. They are batch-invariant, so every
    row comes out bit for bit as a decode step computes it; each call reads the weights once
    for its rows (`runner/prefill_choice.py` measures the paths per machine). W8A8 needs no
    slices: `w8a8_linear` takes any number of rows."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty(flat.shape[0], weight_int8.shape[0], dtype=x.dtype)
    for start in range(0, flat.shape[0], SLICE_ROWS):
        out[start : start + SLICE_ROWS] = run(flat[start : start + SLICE_ROWS], weight_int8, *args)
    return out.view(*x.shape[:-1], weight_int8.shape[0])


def w8a8_linear_ref(x, weight_int8, scale, bias=None) -> torch.Tensor:
    """`w8a8_linear`'s twin: the same activation rounding, then a dense fp32 matmul."""
    w = weight_int8.float() * scale.float()[:, None]
    out = torch.nn.functional.linear(quantize_activations(x), w, bias)
    return out.to(x.dtype)


def prefill_lanes() -> bool:
    """Whether this build's W8A8 products of more than MAX_STEP_ROWS rows (a prefill) sum each
    64-input chunk's integer dot in one lane (`int_gemm.h`, `w8a8_prefill_ref` bit for bit);
    False: they run the step kernels' blocks, a decode step's bits for every row."""
    return bool(_module().W8A8_PREFILL_LANES)


def w8a8_prefill_ref(x, weight_int8, scale, bias=None) -> torch.Tensor:
    """The prefill product's definition (`int_gemm.h`), bit for bit: per 64-input chunk c the
    exact integer dot I = sum w codes, then F = fma(I, step_c, F) in fp32, chunk after chunk,
    then F * scale + bias (fused). fp32 x [M, K] -> [M, N]. (An fp32 fused multiply-add is
    the fp64 sum of its exact product, rounded to fp32: exact but for double rounding, which
    needs an fp64 result exactly halfway between two fp32 values, ~2^-29 of them.)"""
    codes, step = round_symmetric(x.float())  # [M, C, 64], [M, C, 1]
    M, C = codes.shape[:2]
    w = weight_int8.long().reshape(weight_int8.shape[0], C, ACT_CHUNK)
    dots = torch.einsum("mck,nck->mnc", codes.long(), w).double()  # exact: |I| < 2^24
    acc = torch.zeros(M, w.shape[0], dtype=torch.float32)
    for c in range(C):
        acc = (dots[:, :, c] * step[:, c].double() + acc.double()).float()
    scale = scale.double()
    if bias is None:
        return (acc.double() * scale).float()
    return (acc.double() * scale + bias.double()).float()


def int4_usable(x: torch.Tensor, in_features: int, group_size: int) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and in_features % CHUNK == 0
        and group_size % CHUNK == 0
        and x.numel() <= INT4_MAX_ROWS * in_features
        and cpu_ext.available()
    )


def int4_linear(x, packed, scale, zero, group_size: int, bias=None) -> torch.Tensor:
    """x [..., K] (at most INT4_MAX_ROWS rows) through 4-bit weights (packed [N, K/2], scale/zero
    [N, K/G], w = (q - zero) * scale) with x rounded to int8 per 64 inputs (W4A8)."""
    flat = x.reshape(-1, x.shape[-1])
    out = _module().int4_rows_cpu(flat, packed, scale, zero, group_size, bias)
    return out.view(*x.shape[:-1], packed.shape[0])


def int4_linear_ref(x, packed, scale, zero, group_size: int, bias=None) -> torch.Tensor:
    """`int4_linear`'s twin: the same activation rounding, then a dense fp32 matmul."""
    w = dequantize_int4(unpack_int4(packed), scale, zero)
    return torch.nn.functional.linear(quantize_activations(x), w, bias)
