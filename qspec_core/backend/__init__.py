"""Backends run a model's forward on one kind of device with qspec's own kernels.

`select_backend(device)` is the choice, made by device at a model's first forward
(`Transformer.backend`): the CPU backend (`cpu.py`) where qspec's C++ kernels are built, else
None, and the model's plain PyTorch runs (GPUs: its linears and the cache's attention call the
Triton kernels themselves).
"""

from __future__ import annotations

import torch

from kernels.cpu import build
from qspec_core.backend import cpu_stack
from qspec_core.backend.cpu import CPU_BACKEND, CpuBackend

__all__ = ["CpuBackend", "forget_built", "select_backend"]


def select_backend(device: torch.device) -> CpuBackend | None:
    if device.type == "cpu" and build.available():  # (QSPEC_CPU_KERNELS=0 turns it off)
        return CPU_BACKEND
    return None


def forget_built(model) -> None:
    """Drop what any backend built from `model`'s tensors (they are being replaced: `.to`,
    `.float`); cheap, and never builds or loads a kernel."""
    cpu_stack.forget(model)
