"""Pure-PyTorch reference ops. Fused kernels elsewhere in `kernels/` must match these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(input_pos: torch.Tensor, n_keys: int) -> torch.Tensor | None:
    """Additive mask [T, S] letting query i see keys j <= input_pos[i]; None when all see all.

    Additive (0 / -inf) in fp32 rather than bool: SDPA converts a bool mask to this form on
    every call, and the model calls attention once per layer with the same mask.
    """
    if input_pos.shape[0] == 1 and int(input_pos[0]) == n_keys - 1:
        return None  # one query at the newest position sees every key
    key_pos = torch.arange(n_keys, device=input_pos.device)
    visible = key_pos[None, :] <= input_pos[:, None]
    return torch.zeros(visible.shape, device=input_pos.device).masked_fill_(~visible, -torch.inf)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries at positions `input_pos` over keys at positions 0..S-1.

    q [B, H, T, D], k/v [B, n_kv, S, D] with H a multiple of n_kv (GQA), input_pos [T].
    Query i sees keys j <= input_pos[i] (`mask` from `causal_mask`, computed if not given).
    Returns [B, H, T, D].
    """
    gqa = q.shape[1] != k.shape[1]
    if q.shape[2] == k.shape[2] and int(input_pos[0]) == 0:
        # the whole sequence at once: plain causal, which lets the kernel skip masked blocks
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask is None and not (q.shape[2] == 1 and int(input_pos[0]) == k.shape[2] - 1):
        mask = causal_mask(input_pos, k.shape[2])
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _partial_attention(q, k, v, mask, scale):
    """One flash-decoding chunk: unnormalized output and its softmax statistics.

    q [B, n_kv, R, T, D] (R query heads per KV head), k/v [B, n_kv, S, D], mask [T, S] or None.
    Returns acc [B, n_kv, R, T, D] (sum of exp(s - m) v), m and l [B, n_kv, R, T, 1] (row max,
    sum of exp(s - m)). Fully masked rows get m = -inf, l = 0, acc = 0.
    """
    scores = torch.einsum("bhrtd,bhsd->bhrts", q, k) * scale  # [B, n_kv, R, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - safe_m)
    return torch.einsum("bhrts,bhsd->bhrtd", p, v), m, p.sum(-1, keepdim=True)


def merge_partials(parts):
    """Log-sum-exp merge of `_partial_attention` results -> normalized output."""
    m = torch.stack([pm for _, pm, _ in parts]).amax(0)
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    acc = torch.zeros_like(parts[0][0])
    denom = torch.zeros_like(parts[0][2])
    for part_acc, part_m, part_l in parts:
        w = torch.exp(torch.where(torch.isfinite(part_m), part_m - safe_m, part_m))  # 0 if -inf
        acc = acc + part_acc * w
        denom = denom + part_l * w
    return acc / denom


def hierarchical_attention(
    q: torch.Tensor,
    dequant_chunk,
    n_quant: int,
    fp_k: torch.Tensor,
    fp_v: torch.Tensor,
    input_pos: torch.Tensor,
    chunk_size: int,
    fp_hidden: torch.Tensor | None = None,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention over quantized history [0, n_quant) plus a full-precision region, in chunks.

    The structure the fused kernel has: the quantized history is split into chunks of
    `chunk_size` tokens, each dequantized (`dequant_chunk(start, end) -> (k, v)` fp32
    [B, n_kv, end - start, D], in the path's view) and reduced to partial softmax statistics;
    the full-precision region fp_k/fp_v [B, n_kv, F, D] (positions n_quant..n_quant + F - 1)
    is one more chunk with the causal mask; partials merge by log-sum-exp.
    `fp_hidden` [T, F] (bool) hides full-precision keys from some queries, which see those
    positions instead through `extra` = (k, v, visible [T, E]): the oldest full-precision group
    in its quantized view, for queries past the point where it counts as history.
    q [B, H, T, D] at positions input_pos [T] (all >= n_quant). Returns [B, H, T, D] in q's dtype.
    """
    B, H, T, D = q.shape
    n_kv = fp_k.shape[1]
    qg = q.float().view(B, n_kv, H // n_kv, T, D)  # query heads grouped by their KV head
    scale = D**-0.5
    parts = []
    for start in range(0, n_quant, chunk_size):
        k, v = dequant_chunk(start, min(start + chunk_size, n_quant))
        parts.append(_partial_attention(qg, k, v, None, scale))  # history precedes all queries
    if extra is not None:
        parts.append(_partial_attention(qg, extra[0], extra[1], extra[2], scale))
    key_pos = n_quant + torch.arange(fp_k.shape[2], device=q.device)
    mask = key_pos[None, :] <= input_pos[:, None]  # [T, F]
    if fp_hidden is not None:
        mask = mask & ~fp_hidden
    parts.append(_partial_attention(qg, fp_k.float(), fp_v.float(), mask, scale))
    return merge_partials(parts).view(B, H, T, D).to(q.dtype)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor
) -> torch.Tensor:
    """Plain fp32 softmax attention (GQA, causal by position): the check for the chunked one.

    q [B, H, T, D], k/v [B, n_kv, S, D] for positions 0..S-1, input_pos [T].
    """
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    qg = q.float().view(B, n_kv, H // n_kv, T, D)
    scores = torch.einsum("bhrtd,bhsd->bhrts", qg, k.float()) * D**-0.5
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= input_pos[:, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhrts,bhsd->bhrtd", probs, v.float()).reshape(B, H, T, D)
