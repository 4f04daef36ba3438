"""Synthetic inputs for the device_check sections: a hierarchical cache at a given length (its
state, kernel arguments and the bytes a view reads) and random packed 4-bit weights.

The report names the two KV views by their role, "draft" and "target"; the kernels take them
as "int4" (the upper plane) and "int8" (both planes): `KV_VIEW` maps one to the other."""

from __future__ import annotations

import torch
from device_check_harness import Settings

KV_VIEW = {"draft": "int4", "target": "int8"}  # the report's view name -> the kernels' `kv`


def cache_state(length: int, T: int, G: int) -> dict:
    """Lengths and per-query indices after appending T tokens to a cache of `length`
    confirmed tokens (hier_cache's rule): history [0, n_quant), fp region of F tokens from
    n_quant; queries past n_quant + 2G are "late" and see F1 as history."""
    n_quant = max(0, (length // G - 1) * G)
    pos = length + torch.arange(T)
    late = ((pos // G - 1) * G).clamp(min=0) > n_quant
    return {
        "n_quant": n_quant,
        "F": length + T - n_quant,
        "input_pos": pos,
        "n_quant_q": n_quant + G * late.long(),
        "fp_lo": G * late.long(),
    }


def random_cache(s: Settings, n_kv: int, length: int, T: int, exact: bool, seed: int = 0):
    """hier_attention's arguments but the KV view, (q, HierLayerView, QueryRows), for one
    layer at `length`. exact: planes quantized from random K/V with kernels.planes (for
    correctness); else random bytes and scales (for timing, where only the bytes read matter)."""
    from kernels.planes import HierLayerView, QueryRows, quantize_keys, quantize_values

    dev, dtype, D, G = s.device, getattr(torch, s.dtype), s.head_dim, s.group
    st = cache_state(length, T, G)
    S = st["n_quant"] + 2 * G  # room for F1 seen as history by late queries
    gen = torch.Generator(device=dev).manual_seed(seed)
    if exact:
        spread = 0.5 + 3 * torch.rand(D, device=dev, generator=gen)
        k = torch.randn(1, n_kv, S, D, device=dev, generator=gen) * spread + spread
        kq, vq = quantize_keys(k, G), quantize_values(torch.randn_like(k), G)
        planes = (kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero)
    else:

        def byte():  # [1, n_kv, S, D/2] packed nibbles
            return torch.randint(0, 256, (1, n_kv, S, D // 2), device=dev, dtype=torch.uint8)

        def small(*shape):
            return torch.rand(*shape, device=dev, generator=gen) * 0.1

        k_meta, v_meta = (1, n_kv, S // G, D), (1, n_kv, S, D // G)
        planes = (byte(), byte(), small(*k_meta), small(*k_meta))
        planes += (byte(), byte(), small(*v_meta), small(*v_meta))
    fp = torch.randn(2, 1, n_kv, st["F"], D, device=dev, generator=gen).to(dtype)
    q = torch.randn(1, s.heads, T, D, device=dev, generator=gen).to(dtype)
    view = HierLayerView(*planes, fp_k=fp[0], fp_v=fp[1], fp_pos0=st["n_quant"], group_size=G)
    rows = QueryRows(n_quant_q=st["n_quant_q"], fp_lo=st["fp_lo"], input_pos=st["input_pos"])
    return q, view, rows


def history_bytes(s: Settings, n_kv: int, length: int, T: int, view: str) -> float:
    """Bytes a view ("draft" or "target") must read: packed planes and metadata of the
    history, plus the fp region."""
    from kernels.planes import kv_bytes_per_token

    st = cache_state(length, T, s.group)
    per_token = kv_bytes_per_token(s.head_dim, KV_VIEW[view], s.group, s.group).total * n_kv
    n_hist = int(st["n_quant_q"].max())
    fp_bytes = 2 * n_kv * st["F"] * s.head_dim * 2
    return per_token * n_hist + fp_bytes


def int4_weight(n: int, k: int, s: Settings, dev: str):
    """Random packed 4-bit weight [N, K/2] with bf16 scale/zero [N, K/G]."""
    dtype = getattr(torch, s.dtype)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    scale = (torch.rand(n, k // s.weight_group, device=dev) * 0.01).to(dtype)
    zero = torch.full((n, k // s.weight_group), 8.0, device=dev).to(dtype)
    return packed, scale, zero
