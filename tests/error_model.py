"""Tolerances from an error model instead of fixed atol/rtol (the scheme of FlagAttention's
tests): run the kernel, PyTorch's fp32 reference and a float64 reference on the same inputs;
the kernel's largest error against float64 may be at most `factor` times PyTorch's own, plus
a few fp32 ulps of the output's magnitude (the floor for an output PyTorch happens to get
almost exactly). A bound that scales with the rounding actually present, so it neither fails
on a CPU whose vector width changes the summation order nor lets a real error through where
the outputs are small.

Also the float64 attention over dequantized K/V that the references here share, and over one
layer of the hierarchical cache (`hier_attention64`, the arguments of `kernels.attention`).
"""

import torch

from kernels.formats import QUERY_LEVELS, round_symmetric
from kernels.planes import LOWER_OFFSET, HierLayerView, QueryRows, unpack_nibbles
from kernels.reference import dequantize_history

EPS32 = torch.finfo(torch.float32).eps


def error_bound(ref32, ref64, factor: float, ulps: float = 2.0) -> tuple[float, float]:
    """(bound on the kernel's max error, PyTorch's max error), both against ref64."""
    torch_err = (ref32.double() - ref64).abs().max().item()
    return factor * torch_err + ulps * EPS32 * ref64.abs().max().item(), torch_err


# PyTorch's reference must itself agree with float64 to single precision, or a bound scaled
# by its error says nothing: rounding stays far below this, any wrong key or mask far above.
SANE = 2.0**-13


def assert_within_error_model(got, ref32, ref64, factor: float, ulps: float = 2.0, what=""):
    """|got - ref64| <= factor |ref32 - ref64| + ulps eps32 |ref64| (maxima over all
    elements); returns (got's error, PyTorch's error)."""
    assert got.shape == ref32.shape == ref64.shape and ref64.dtype == torch.float64
    err = (got.double() - ref64).abs().max().item()
    bound, torch_err = error_bound(ref32, ref64, factor, ulps)
    mag = ref64.abs().max().item()
    assert torch_err <= SANE * mag, f"{what}: the fp32 reference is off by {torch_err:.3g}"
    assert err <= bound, (
        f"{what}: max |got - float64| = {err:.3g} exceeds {factor:g} x PyTorch fp32's "
        f"{torch_err:.3g} + {ulps:g} ulps of {mag:.3g} = {bound:.3g}"
    )
    return err, torch_err


def attention64(q, k, v, visible, hist_scores=None):
    """Softmax attention in float64: q [B, H, T, D], k/v [B, n_kv, S, D] (GQA), visible
    bool [T, S]. A query that sees no key gets zeros. hist_scores [B, n_kv, R, T, n]: the
    scores of the first n keys, used instead of q . k (the int8 queries' history scores)."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    qg = q.double().view(B, n_kv, H // n_kv, T, D)
    scores = torch.einsum("bhrtd,bhsd->bhrts", qg, k.double()) * D**-0.5
    if hist_scores is not None:
        scores[..., : hist_scores.shape[-1]] = hist_scores
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)
    return torch.einsum("bhrts,bhsd->bhrtd", probs, v.double()).reshape(B, H, T, D)


def int_query_scores64(q, view: HierLayerView, n: int, kv: str):
    """History scores [B, n_kv, R, T, n] of queries rounded to int16 as the kernels round them
    (codes and steps from fp32 q / sqrt(D) times the K group's scales), the rest in float64:
    step * (codes . u) + q . (z - off s), u the plane bytes (`kernels/cpu/attention_int.h`)."""
    B, H, T, D = q.shape
    n_kv, G = view.k_upper.shape[1], view.group_size
    div, off = (16.0, float(LOWER_OFFSET)) if kv == "int8" else (1.0, 0.0)
    qs = q.float().view(B, n_kv, H // n_kv, T, D) * D**-0.5
    s32 = view.k_scale[:, :, : n // G].float() / div
    a = qs[:, :, :, :, None] * s32[:, :, None, None]
    codes, step = round_symmetric(a, chunk=D, levels=QUERY_LEVELS)
    s64 = view.k_scale[:, :, : n // G].double() / div
    z64 = view.k_zero[:, :, : n // G].double()
    bias = (qs.double()[:, :, :, :, None] * (z64 - off * s64)[:, :, None, None]).sum(-1)
    u = unpack_nibbles(view.k_upper[:, :, :n]).double()
    if kv == "int8":
        u = 16 * u + unpack_nibbles(view.k_lower[:, :, :n]).double()
    u = u.view(B, n_kv, n // G, G, D)
    dots = torch.einsum("bhrtgd,bhgjd->bhrtgj", codes.squeeze(-2).double(), u)
    scores = dots * step.squeeze(-1).double() + bias[..., None]
    return scores.reshape(B, n_kv, H // n_kv, T, n)


def hier_attention64(q, view: HierLayerView, rows: QueryRows, kv: str, int_queries=False):
    """The attention `kernels.attention.hier_attention` computes, in float64: the same planes
    dequantized exactly, the same full-precision region and the same per-query visibility
    (history j < n_quant_q[t]; fp key j with fp_lo[t] <= j and fp_pos0 + j <= input_pos[t];
    under a sliding window only keys at positions > input_pos[t] - window); with
    int_queries, the history scored by `int_query_scores64`."""
    n_quant_q, fp_lo, pos = (torch.as_tensor(x).cpu() for x in (rows.n_quant_q, rows.fp_lo,
                                                                 rows.input_pos))  # fmt: skip
    n = int(n_quant_q.max())
    keys, values = dequantize_history(view, n, kv, torch.float64)  # (the codes' exact values)
    j = torch.arange(view.fp_k.shape[2])
    visible = torch.cat(
        (
            torch.arange(n)[None, :] < n_quant_q[:, None],
            (j[None, :] >= fp_lo[:, None]) & (view.fp_pos0 + j[None, :] <= pos[:, None]),
        ),
        dim=1,
    )
    if rows.window is not None:  # (key positions: j in the history, fp_pos0 + j in the region)
        key_pos = torch.cat((torch.arange(n), view.fp_pos0 + j))
        visible &= key_pos[None, :] > pos[:, None] - rows.window
    keys = torch.cat((keys, view.fp_k.double()), 2)
    values = torch.cat((values, view.fp_v.double()), 2)
    hist = int_query_scores64(q, view, n, kv) if int_queries and n else None
    return attention64(q, keys, values, visible, hist)
