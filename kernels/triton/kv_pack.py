"""Quantize-and-pack of K/V into the hierarchical INT4/INT8 layout, in Triton (prefill, F1
rotation).

`quantize_keys_triton` / `quantize_values_triton` return the same `QuantizedGroupTensor` as
`kernels.planes.quantize_keys` / `quantize_values`, their PyTorch twins, bit for bit:
same planes, same fp32 scale and zero (the kernels, `kernels.triton.jit.kv_pack`, imported
only when they run, say how).

Non-finite inputs are not checked here (the twin raises; this path would need a device sync
to do so). Where Triton cannot run, the wrappers call the twins.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.planes import QuantizedGroupTensor, quantize_keys, quantize_values
from kernels.triton.runs import kernel_runs_on

# ---------------------------------------------------------------------------------------------
# Checks, the kernels' launch (`kernels.triton.jit.kv_pack`) and the public wrappers


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"{name} must be [B, n_kv, T, D] with an even D, got {tuple(x.shape)}")


def _jit() -> ModuleType:
    """The kernels' module, imported (with Triton) on first use."""
    from kernels.triton.jit import kv_pack

    return kv_pack


def _launch_keys(k: torch.Tensor, group_size: int) -> QuantizedGroupTensor:
    _check(k, "keys")
    T = k.shape[2]
    if group_size < 1 or T % group_size:
        raise ValueError(f"keys: T={T} must be a multiple of group_size={group_size}")
    return _jit().launch_keys(k, group_size)


def _launch_values(v: torch.Tensor, group_size: int | None) -> QuantizedGroupTensor:
    _check(v, "values")
    D = v.shape[-1]
    G = D if group_size is None else group_size
    if G < 2 or G % 2 or D % G:
        raise ValueError(f"values: group_size={G} must be even and divide head_dim={D}")
    return _jit().launch_values(v, G)


def triton_usable(x: torch.Tensor) -> bool:
    """Whether the wrappers run Triton for x: on CUDA, or on CPU with the interpreter on
    (now, and when its jit module was imported)."""
    return kernel_runs_on(_jit, x)


def quantize_keys_triton(k: torch.Tensor, group_size: int) -> QuantizedGroupTensor:
    """`kernels.planes.quantize_keys` in Triton: keys [B, n_kv, T, D], per channel per G tokens.
    G and D must be powers of two (Triton tiles); other shapes go to the twin."""
    if triton_usable(k) and _pow2(group_size) and _pow2(k.shape[-1]):
        return _launch_keys(k, group_size)
    return quantize_keys(k, group_size)


def quantize_values_triton(v: torch.Tensor, group_size: int | None = None) -> QuantizedGroupTensor:
    """`kernels.planes.quantize_values` in Triton: values [B, n_kv, T, D], per token per G channels
    (G defaults to D). G and D must be powers of two; other shapes go to the twin."""
    G = v.shape[-1] if group_size is None else group_size
    if triton_usable(v) and _pow2(G) and _pow2(v.shape[-1]):
        return _launch_values(v, G)
    return quantize_values(v, group_size)


def _pow2(n: int) -> bool:
    return n >= 2 and n & (n - 1) == 0
