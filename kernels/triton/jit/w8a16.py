"""The W8A16 matmul kernel and its launch (the host half, with the layout, the twin and the
dispatch: `kernels.triton.w8a16`)."""

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
#   verify (M <= 16) run with BLOCK_M = 16 and masked rows: at these M the kernel is bound by
#   the weight bytes, so the padded rows cost FLOPs, not bandwidth.
# - The scale is per output channel, so it factors out of the K sum: the loop accumulates
#   x @ q^T on the raw integers (exact in fp32 up to |q| <= 127) and the program multiplies by
#   scale[BLOCK_N] once, after the loop (one multiply per output, not per weight).
# - x and q are both cast to fp32 before tl.dot: bf16 tl.dot is wrong in the interpreter, and
#   fp32 with input_precision="ieee" keeps the kernel as exact as the fp32 twin on GPUs.
# - K may be any size: the last K-block is masked (masked x and q load 0 and add nothing);
#   M and N tails are masked on load and store.
# - A bf16 result is rounded to nearest-even before the store (`round_to_bf16_grid`, shared
#   with the W4A16 kernel, `common.py`): the interpreter's own fp32 -> bf16 cast truncates.


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K] activations (fp32 / bf16 / fp16)
    w_ptr,  # [N, K] int8
    scale_ptr,  # [N]
    bias_ptr,  # [N]; unused (any valid pointer) when HAS_BIAS is False
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    mask_n = offs_n < N

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K  # [BK]; only the last block has a tail
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        q = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)  # [BN, BK] int8
        acc = tl.dot(x.to(tl.float32), tl.trans(q.to(tl.float32)), acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
    acc = acc * scale[None, :]  # [BM, BN]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
        acc = acc + bias[None, :]
    if y_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16_grid(acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn  # [BM, BN]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


INTERPRETED = interpreted(_w8a16_kernel)  # (`kernels.triton.runs.kernel_runs_on`)

# ---------------------------------------------------------------------------------------------
# Launch config and launch


def _launch_config(m: int, n: int, on_cuda: bool) -> dict:
    """Fixed block sizes per shape class (no autotune: multi-config autotune fails in the
    interpreter).

    Decode (M = 1) and verify (M <= 16) share BLOCK_M = 16; M <= 32 gets 32 rows, larger M
    64-row tiles. On CUDA, small M is a GEMV bound by the int8 weight stream, so narrow N
    tiles (32) and deep K blocks (128 bytes of each weight row per step) give enough programs
    to fill the SMs; large M is compute-bound and takes 64 x 64 tiles with BLOCK_K = 64 to
    keep the fp32 operand tiles in registers. The interpreter's cost grows with the number of
    programs and loop steps, so it gets wide, deep tiles.
    """
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if not on_cuda:
        return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
    if m <= 32:
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4}
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}


def launch(
    x: torch.Tensor,
    w_int8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the kernel on x [..., K] -> y [..., N]; the operands were checked by the host
    (`kernels.triton.w8a16._launch`)."""
    n, k = w_int8.shape
    scale = scale.contiguous()  # [N], read with unit stride
    bias = None if bias is None else bias.contiguous()

    def fill(x2: torch.Tensor, y: torch.Tensor) -> None:  # rows [M, K] -> y [M, N]
        m = x2.shape[0]
        if k == 0:  # an empty sum: y is the bias, or zeros
            y.zero_() if bias is None else y.copy_(bias.expand(m, n))
            return
        config = _launch_config(m, n, x.is_cuda)
        grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
        _w8a16_kernel[grid](
            x2, w_int8, scale,
            scale if bias is None else bias,  # any valid pointer: the kernel skips it
            y, m, n, k, *x2.stride(), *w_int8.stride(), *y.stride(),
            HAS_BIAS=bias is not None, **config,
        )  # fmt: skip

    return launch_matmul(x, k, n, fill)
