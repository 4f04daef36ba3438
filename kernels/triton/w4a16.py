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
the Triton kernel on CUDA tensors (or on CPU under `TRITON_INTERPRET=1`) and the twin
everywhere else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import unpack_int4
from kernels.triton.runs import kernel_runs_on, launch_matmul

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
# Triton kernel
#
# Design:
# - Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); one program owns a [BLOCK_M, BLOCK_N] tile of y
#   and walks K in steps of BLOCK_K. tl.dot needs every block dim >= 16, so decode (M = 1) and
#   verify (M <= 16) both run with BLOCK_M = 16 and masked rows; the kernel is memory-bound at
#   these M, so the padded rows cost FLOPs, not bytes.
# - BLOCK_K divides G (the wrapper uses min(G, 128)), so a K-block lies inside one group and
#   the program loads one scale and one zero per output column per K-block ([BLOCK_N]), not
#   a per-element gather.
# - The packed bytes [BLOCK_N, BLOCK_K // 2] are unpacked in registers (`& 0xF` low, `>> 4`
#   high) and put back in k order with tl.interleave -> [BLOCK_N, BLOCK_K], then dequantized
#   in fp32. x is cast to fp32 too: bf16 tl.dot is wrong in the interpreter, and fp32 with
#   input_precision="ieee" keeps the kernel as exact as the fp32 twin on GPUs (tf32 would not).
# - A bf16 result is rounded to nearest-even in integer ops before the store
#   (`_round_to_bf16_grid`): the interpreter's own fp32 -> bf16 cast truncates.
# - K % G == 0 and BLOCK_K | G, so K needs no mask; M and N tails are masked (masked weights
#   load q = 0, scale = 0 and contribute nothing).


@triton.jit
def _round_to_bf16_grid(value):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32.

    Triton's interpreter casts fp32 to bf16 by truncation, GPUs round to nearest even; rounding
    here first makes the final cast exact on both, so the interpreter tests what a GPU stores.
    NaN and inf keep their class; finite values past the bf16 range round to inf, as in torch.
    """
    bits = value.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations (fp32 / bf16 / fp16)
    packed_ptr,  # [N, K // 2] uint8, k = 2i low nibble, 2i + 1 high nibble
    scale_ptr,  # [N, K // G]
    zero_ptr,  # [N, K // G]
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_pn,
    stride_pk,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_ym,
    stride_yn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    HALF_K: tl.constexpr = BLOCK_K // 2

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    offs_byte = tl.arange(0, HALF_K)  # [BLOCK_K // 2]
    mask_m = offs_m < M
    mask_n = offs_n < N

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    p_ptrs = packed_ptr + offs_n[:, None] * stride_pn + offs_byte[None, :] * stride_pk  # [BN, BK/2]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP_SIZE  # the whole K-block lies in this group
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)  # [BM, BK]
        byte = tl.load(p_ptrs, mask=mask_n[:, None], other=0)  # [BN, BK/2] uint8
        low = (byte & 0xF).to(tl.float32)  # [BN, BK/2], elements k0 + 2i
        high = (byte >> 4).to(tl.float32)  # [BN, BK/2], elements k0 + 2i + 1
        q = tl.interleave(low, high)  # [BN, BK] in k order
        scale = tl.load(scale_ptr + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)
        zero = tl.load(zero_ptr + offs_n * stride_zn + group * stride_zg, mask=mask_n, other=0.0)
        w = (q - zero.to(tl.float32)[:, None]) * scale.to(tl.float32)[:, None]  # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")  # [BM, BN]
        x_ptrs += BLOCK_K * stride_xk
        p_ptrs += HALF_K * stride_pk

    if y_ptr.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16_grid(acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn  # [BM, BN]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------------------------------------
# Launch config and public wrapper


def _launch_config(m: int, n: int, group_size: int, on_cuda: bool) -> dict:
    """Fixed block sizes per shape class (no autotune: multi-config autotune fails in the
    interpreter).

    BLOCK_M = 16 covers decode (M = 1) and verify (M <= 16); larger M gets 32/64-row tiles.
    On CUDA, narrower N tiles give a GEMV enough programs to fill the SMs; the interpreter's
    cost grows with the number of programs, so it gets wide tiles.
    """
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = (32 if m <= 16 else 64) if on_cuda else 64
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": min(group_size, 128),
        "num_warps": 4,
    }


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
    n, k = _check(x, packed, scale, zero, group_size)

    def fill(x2: torch.Tensor, y: torch.Tensor) -> None:  # rows [M, K] -> y [M, N]
        m = x2.shape[0]
        config = _launch_config(m, n, group_size, x.is_cuda)
        grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
        _w4a16_kernel[grid](
            x2, packed, scale, zero, y, m, n, k,
            *x2.stride(), *packed.stride(), *scale.stride(), *zero.stride(), *y.stride(),
            GROUP_SIZE=group_size, **config,
        )  # fmt: skip

    return launch_matmul(x, k, n, fill)


def triton_usable(x: torch.Tensor) -> bool:
    """Whether `w4a16_matmul` runs the Triton kernel for x (`kernel_runs_on`: on CUDA, or on
    CPU in the interpreter)."""
    return kernel_runs_on(_w4a16_kernel, x)


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
