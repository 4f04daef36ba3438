"""The W4A16 matmul kernel and its launch (the host half, with the layout, the twin and the
dispatch: `kernels.triton.w4a16`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.jit.common import interpreted, round_to_bf16_grid
from kernels.triton.runs import launch_matmul

# ---------------------------------------------------------------------------------------------
# Triton kernel
#
# Design:
# - Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); one program owns a [BLOCK_M, BLOCK_N] tile of y
#   and walks K in steps of BLOCK_K. tl.dot needs every block dim >= 16, so decode (M = 1) and
#   verify (M <= 16) both run with BLOCK_M = 16 and masked rows; the kernel is memory-bound at
#   these M, so the padded rows cost FLOPs, not bytes.
# - BLOCK_K divides G (the launch uses min(G, 128)), so a K-block lies inside one group and
#   the program loads one scale and one zero per output column per K-block ([BLOCK_N]), not
#   a per-element gather.
# - The packed bytes [BLOCK_N, BLOCK_K // 2] are unpacked in registers (`& 0xF` low, `>> 4`
#   high) and put back in k order with tl.interleave -> [BLOCK_N, BLOCK_K], then dequantized
#   in fp32. x is cast to fp32 too: bf16 tl.dot is wrong in the interpreter, and fp32 with
#   input_precision="ieee" keeps the kernel as exact as the fp32 twin on GPUs (tf32 would not).
# - A bf16 result is rounded to nearest-even in integer ops before the store
#   (`round_to_bf16_grid`): the interpreter's own fp32 -> bf16 cast truncates.
# - K % G == 0 and BLOCK_K | G, so K needs no mask; M and N tails are masked (masked weights
#   load q = 0, scale = 0 and contribute nothing).


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
        acc = round_to_bf16_grid(acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn  # [BM, BN]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


INTERPRETED = interpreted(_w4a16_kernel)  # (`kernels.triton.runs.kernel_runs_on`)

# ---------------------------------------------------------------------------------------------
# Launch config and launch


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


def launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Run the kernel on x [..., K] -> y [..., N]; the operands were checked by the host
    (`kernels.triton.w4a16._launch`), group_size is one of its GROUP_SIZES."""
    n, k = packed.shape[0], packed.shape[1] * 2

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
