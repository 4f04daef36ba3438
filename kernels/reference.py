"""Pure-PyTorch reference attention. Fused kernels elsewhere in `kernels/` must match these.

`causal_attention` (with `causal_mask`) over a full-precision cache; `hier_attention_ref`
over one layer of the hierarchical INT4/INT8 cache (`kernels.planes`), the twin of the
Triton and C++ kernels that `kernels.attention.hier_attention` dispatches to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.formats import QUERY_LEVELS, QUERY_MAX_DIM, round_symmetric
from kernels.planes import (
    LOWER_OFFSET,
    HierLayerView,
    QuantizedGroupTensor,
    QueryRows,
    dequantize_keys,
    dequantize_values,
    unpack_nibbles,
)


def causal_mask(
    input_pos: torch.Tensor, n_keys: int, window: int | None = None
) -> torch.Tensor | None:
    """Additive mask [T, S] letting query i see keys j <= input_pos[i] (and, with a sliding
    `window`, j > input_pos[i] - window); None when all see all.

    Additive (0 / -inf) in fp32 rather than bool: SDPA converts a bool mask to this form on
    every call, and the model calls attention once per layer with the same mask.
    """
    if input_pos.shape[0] == 1 and int(input_pos[0]) == n_keys - 1 and not cuts(window, n_keys):
        return None  # one query at the newest position sees every key
    visible = causal_visible(input_pos, n_keys, window)
    return torch.zeros(visible.shape, device=input_pos.device).masked_fill_(~visible, -torch.inf)


def causal_visible(input_pos: torch.Tensor, n_keys: int, window: int | None = None):
    """bool [T, S]: query i sees key j (j <= input_pos[i], and j > input_pos[i] - window)."""
    key_pos = torch.arange(n_keys, device=input_pos.device)[None, :]
    visible = key_pos <= input_pos[:, None]
    if window is not None:
        visible &= key_pos > input_pos[:, None] - window
    return visible


def window_start(position: int, window: int | None) -> int:
    """The oldest key position a query at `position` sees under a sliding `window` (0: all)."""
    return 0 if window is None else max(0, position - window + 1)


def cuts(window: int | None, n_keys: int) -> bool:
    """Whether a sliding `window` hides any of n_keys keys (positions 0..n_keys-1) from a
    query among them: below that length a local layer attends as a global one."""
    return window is not None and n_keys > window


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of queries at positions `input_pos` over keys at positions 0..S-1.

    q [B, H, T, D], k/v [B, n_kv, S, D] with H a multiple of n_kv (GQA), input_pos [T].
    Query i sees keys j <= input_pos[i] (`mask` from `causal_mask`, computed if not given),
    and with a sliding `window` (a local layer's) only j > input_pos[i] - window.
    `softcap`: Gemma 2's attn_logit_softcapping (`soft_cap`). Returns [B, H, T, D].
    """
    if softcap is not None:
        return _softcapped_attention(q, k, v, input_pos, softcap, window)
    gqa = q.shape[1] != k.shape[1]
    windowed = cuts(window, k.shape[2])
    if q.shape[2] == k.shape[2] and int(input_pos[0]) == 0 and not windowed:
        # the whole sequence at once: plain causal, which lets the kernel skip masked blocks
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    newest = q.shape[2] == 1 and int(input_pos[0]) == k.shape[2] - 1
    if mask is None and (windowed or not newest):
        mask = causal_mask(input_pos, k.shape[2], window)
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping: cap * tanh(scores / cap), in the scores' dtype (None:
    the scores as they are). Attention applies it to the scaled scores before the mask."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softcapped_attention(q, k, v, input_pos, cap: float, window=None) -> torch.Tensor:
    """`causal_attention` with soft-capped scores, written out (SDPA has no soft cap), as
    transformers' eager Gemma 2 attention: scaled scores, cap, mask, fp32 softmax."""
    B, H, T, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    qg = q.float().view(B, n_kv, H // n_kv, T, D)  # query heads grouped by their KV head
    scores = soft_cap(torch.einsum("bhrtd,bhsd->bhrts", qg, k.float()) * D**-0.5, cap)
    visible = causal_visible(input_pos.to(q.device), S, window)  # [T, S]
    return _attend(scores, visible, v.float(), q)


def _attend(scores, visible, values, q) -> torch.Tensor:
    """The fp32 softmax of grouped scores [B, n_kv, R, T, S] over the visible keys (a query
    that sees none gets zeros, not NaN), times values [B, n_kv, S, D] -> q's shape and dtype."""
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)
    return torch.einsum("bhrts,bhsd->bhrtd", probs, values).reshape(q.shape).to(q.dtype)


def dequantize_history(
    view: HierLayerView, n_hist: int, kv: str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's quantized history [0, n_hist) (whole K groups) dequantized in the KV view `kv`:
    (keys, values) [B, n_kv, n_hist, D], computed in `dtype`: fp32 is the cache's own math,
    float64 the exact values the codes stand for (what the tests' error model compares to)."""
    G, hist = view.group_size, slice(0, n_hist)
    keys = QuantizedGroupTensor(
        view.k_upper[:, :, hist], view.k_lower[:, :, hist],
        view.k_scale[:, :, : n_hist // G].to(dtype), view.k_zero[:, :, : n_hist // G].to(dtype),
    )  # fmt: skip
    values = QuantizedGroupTensor(
        view.v_upper[:, :, hist], view.v_lower[:, :, hist],
        view.v_scale[:, :, hist].to(dtype), view.v_zero[:, :, hist].to(dtype),
    )  # fmt: skip
    return dequantize_keys(keys, G, kv), dequantize_values(values, G, kv)


def _visibility(
    index: torch.Tensor, n_hist: int, n_fp: int, fp_pos0: int, device, parents=None, window=None
) -> torch.Tensor:
    """Which keys each query sees: bool [T, n_hist + F] (history first, then the fp region);
    `parents`: a token tree's, `window`: a local layer's (`QueryRows`)."""
    n_quant_q, input_pos, fp_lo = (row.to(device) for row in index)
    key_pos = torch.arange(n_hist, device=device)[None, :]  # a history key's position: j
    hist = key_pos < n_quant_q[:, None]  # [T, n_hist]
    j = torch.arange(n_fp, device=device)[None, :]
    fp_pos = (fp_pos0 + j).expand(input_pos.shape[0], n_fp).clone()  # [T, F] key positions
    if parents is None:
        fp = (j >= fp_lo[:, None]) & (fp_pos <= input_pos[:, None])  # [T, F]
    else:
        T, w = input_pos.shape[0], int(input_pos[0]) - fp_pos0
        own = tree_ancestors(parents).to(device)  # [T, T]: query t sees query s's K/V
        fp = (j >= fp_lo[:, None]) & (j < w)
        fp[:, w : w + T] |= own
        fp_pos[:, w : w + T] = input_pos[None, :]  # (a tree row's K/V: at its depth's)
    if window is not None:  # a local layer: the last `window` positions only
        hist &= key_pos > input_pos[:, None] - window
        fp &= fp_pos > input_pos[:, None] - window
    return torch.cat((hist, fp), dim=1)


def tree_ancestors(parents) -> torch.Tensor:
    """bool [T, T]: row t's ancestors and itself, of a tree given by parents [T] (parents[t]
    an earlier row, -1 a root)."""
    parents = [int(x) for x in torch.as_tensor(parents).reshape(-1).tolist()]
    T = len(parents)
    seen = torch.zeros(T, T, dtype=torch.bool)
    for t, up in enumerate(parents):
        if not -1 <= up < t:
            raise ValueError(f"parents[{t}] = {up}: a parent is an earlier row, or -1")
        if up >= 0:
            seen[t] = seen[up]
        seen[t, t] = True
    return seen


def _int_query_scores(qs: torch.Tensor, view: HierLayerView, n_hist: int, kv: str):
    """Scores [B, n_kv, R, T, n_hist] of the scaled queries qs [B, n_kv, R, T, D] against the
    quantized history, the queries rounded to int16 per row and K group (`kernels/cpu/
    attention_int.h` states the math): step * (codes . u) + bias, with u the plane bytes, U
    (int4 view) or 16 U + lower (int8 view), and the integer dot exact in float64."""
    B, n_kv, R, T, D = qs.shape
    if D > QUERY_MAX_DIM:  # (as the C++ kernel refuses)
        raise ValueError(f"integer queries need head_dim <= {QUERY_MAX_DIM}, not {D}")
    G = view.group_size
    if n_hist == 0:
        return qs.new_zeros(B, n_kv, R, T, 0)
    div, off = (16.0, float(LOWER_OFFSET)) if kv == "int8" else (1.0, 0.0)
    s = view.k_scale[:, :, : n_hist // G].float() / div  # [B, n_kv, n_g, D]
    z = view.k_zero[:, :, : n_hist // G].float()
    a = qs[:, :, :, :, None, :] * s[:, :, None, None]  # [B, n_kv, R, T, n_g, D]
    codes, step = round_symmetric(a, chunk=D, levels=QUERY_LEVELS)  # [..., 1, D], [..., 1, 1]
    bias = (qs[:, :, :, :, None, :] * (z - off * s)[:, :, None, None]).sum(-1)
    u = unpack_nibbles(view.k_upper[:, :, :n_hist]).double()  # [B, n_kv, n_hist, D]
    if kv == "int8":
        u = 16 * u + unpack_nibbles(view.k_lower[:, :, :n_hist]).double()
    u = u.view(B, n_kv, n_hist // G, G, D)
    dots = torch.einsum("bhrtgd,bhgjd->bhrtgj", codes.squeeze(-2).double(), u).float()
    scores = dots * step.squeeze(-1) + bias[..., None]  # [B, n_kv, R, T, n_g, G]
    return scores.reshape(B, n_kv, R, T, n_hist)


def hier_attention_ref(
    q: torch.Tensor,
    view: HierLayerView,
    rows: QueryRows,
    kv: str,
    chunk_size: int | None = None,
    int_queries: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over one layer of the hierarchical cache, written plainly: dequantize the
    visible history in the KV view `kv` ("int8": both planes, "int4": the upper plane), append
    the full-precision region, one masked fp32 softmax. q [B, H, T, D] (H a multiple of
    n_kv); visibility per query from `rows` (`QueryRows`). Returns [B, H, T, D] in q's dtype;
    a query that sees no key gets zeros.

    The twin of the Triton kernel (`kernels/triton/hier_attention.py`) and the C++ one
    (`kernels/cpu/hier_attention.cpp`), which take the same arguments. `chunk_size` (their
    history tokens per program) does not apply to one softmax and is ignored.

    int_queries: score the quantized history with the queries rounded to int16 per row and K
    group (`_int_query_scores`), as the C++ kernel does for the W8A8 target and the W4A8
    draft; the full-precision region keeps fp32 queries. `softcap`: the scores soft-capped
    (`soft_cap`) before the mask.
    """
    view.check(q, kv)
    B, H, T, D = q.shape
    n_kv = view.k_upper.shape[1]
    index = rows.index(T)
    n_hist = int(index[0].max()) if T else 0
    keys, values = dequantize_history(view, n_hist, kv)
    keys = torch.cat((keys, view.fp_k.float()), dim=2)  # [B, n_kv, n_hist + F, D]
    values = torch.cat((values, view.fp_v.float()), dim=2)
    visible = _visibility(
        index, n_hist, view.fp_k.shape[2], int(view.fp_pos0), q.device, rows.parents, rows.window
    )

    qg = q.float().view(B, n_kv, H // n_kv, T, D)  # query heads grouped by their KV head
    if int_queries:
        qs = qg * D**-0.5  # (scaled first, as the kernel does: the rounding sees these)
        scores = torch.cat(
            (
                _int_query_scores(qs, view, n_hist, kv),
                torch.einsum("bhrtd,bhsd->bhrts", qs, keys[:, :, n_hist:]),
            ),
            dim=-1,
        )
    else:
        scores = torch.einsum("bhrtd,bhsd->bhrts", qg, keys) * D**-0.5
    return _attend(soft_cap(scores, softcap), visible, values, q)
