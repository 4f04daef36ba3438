"""What the Triton kernel modules share: whether a kernel can run for a tensor here, and
the rows a matmul kernel (W4A16, W8A16) takes."""

from __future__ import annotations

import os

import torch


def kernel_runs_on(kernel, x: torch.Tensor) -> bool:
    """On CUDA always; on CPU only in the interpreter: TRITON_INTERPRET=1 now, and it was on
    when `kernel`'s module was imported (triton.jit picks compiled vs interpreted then)."""
    if x.is_cuda:
        return True
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    return interpreted and os.environ.get("TRITON_INTERPRET") == "1"


def matmul_rows(x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as the kernel's rows [M, K], and the output y [M, N] it fills (uninitialized,
    in x's dtype and on its device)."""
    x2 = x.reshape(-1, k)
    return x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
