"""What the Triton kernel modules share: whether a kernel can run for a tensor here, and
the launch around a matmul kernel (W4A16, W8A16): its rows in, its output back. Triton-free,
like the host modules that use it (`kernels/triton/__init__.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import torch


def kernel_runs_on(jit: Callable[[], ModuleType], x: torch.Tensor) -> bool:
    """Whether the kernels of the jit module that `jit()` imports run for x. On CUDA always;
    on CPU only in the interpreter: TRITON_INTERPRET=1 now, and it was on when the jit module
    was imported (triton.jit picks compiled vs interpreted then, its INTERPRETED). Calls `jit`
    (which imports Triton) only in that second case: on a CPU without the interpreter, nothing
    of Triton loads."""
    if x.is_cuda:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return jit().INTERPRETED


def launch_matmul(
    x: torch.Tensor, k: int, n: int, fill: Callable[[torch.Tensor, torch.Tensor], None]
) -> torch.Tensor:
    """A matmul kernel's launch around `fill(x2, y)`: x [..., K] as the kernel's rows x2 [M, K],
    y [M, N] uninitialized in x's dtype and on its device for `fill` to write, returned as
    [..., N]. `fill` is not called when y is empty (M = 0 or N = 0: nothing to launch)."""
    x2 = x.reshape(-1, k)  # [M, K]
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)  # [M, N]
    if y.numel():
        fill(x2, y)
    return y.reshape(*x.shape[:-1], n)
