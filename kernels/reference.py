"""Pure-PyTorch reference ops. Fused kernels elsewhere in `kernels/` must match these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor
) -> torch.Tensor:
    """Attention of queries at positions `input_pos` over keys at positions 0..S-1.

    q [B, H, T, D], k/v [B, n_kv, S, D] with H a multiple of n_kv (GQA), input_pos [T].
    Query i sees keys j <= input_pos[i]. Returns [B, H, T, D].
    """
    if q.shape[2] == 1 and int(input_pos[0]) == k.shape[2] - 1:
        mask = None  # one query at the newest position sees every key
    else:
        key_pos = torch.arange(k.shape[2], device=q.device)
        mask = key_pos[None, :] <= input_pos[:, None]  # [T, S]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )
