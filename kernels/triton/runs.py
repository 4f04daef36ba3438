"""Whether a Triton kernel can run for a tensor here: shared by every kernel module."""

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
