"""The CPU fast path of the hierarchical-KV attention: `hier_attention.cpp`.

Same arguments as `kernels.hier_attention.hier_attention` (the Triton kernel) and its PyTorch
twin `hier_attention_ref`, which the tests compare it against. Built by `cpu_ext` on first
use; when it cannot be built, `available()` is False and the cache keeps the reference path.
"""

from __future__ import annotations

import torch

from kernels.cpu import build as cpu_ext


def available() -> bool:
    return cpu_ext.available()


def hier_attention_cpu(
    q,
    k_upper,
    k_lower,
    k_scale,
    k_zero,
    v_upper,
    v_lower,
    v_scale,
    v_zero,
    n_quant_q,
    fp_k,
    fp_v,
    fp_pos0,
    fp_lo,
    input_pos,
    view,
    group_size,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Attention over one layer of the hierarchical cache (see `kernels/hier_attention.py` for
    the argument contract); returns [B, H, T, D] in q's dtype (a view of a [B, T, H, D]
    buffer: the output projection's transpose(1, 2).reshape is then free)."""
    module = cpu_ext.load()
    if module is None:
        raise RuntimeError(f"CPU attention kernel unavailable: {cpu_ext.failure()}")
    # fp_k/fp_v: the cache's full-precision slice is read in place (strided, fp32)
    fp_k = (
        fp_k if fp_k.dtype == torch.float32 and fp_k.stride(-1) == 1 else fp_k.float().contiguous()
    )
    fp_v = (
        fp_v if fp_v.dtype == torch.float32 and fp_v.stride(-1) == 1 else fp_v.float().contiguous()
    )
    out = module.hier_attention_cpu(
        q,
        k_upper,
        k_lower,
        k_scale,
        k_zero,
        v_upper,
        v_lower,
        v_scale,
        v_zero,
        torch.as_tensor(n_quant_q),
        fp_k,
        fp_v,
        int(fp_pos0),
        torch.as_tensor(fp_lo),
        torch.as_tensor(input_pos),
        view == "target",
        int(group_size),
        int(chunk_size),
    )
    return out.to(q.dtype)
