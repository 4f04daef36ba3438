"""Hierarchical INT4/INT8 KV quantizer: packing, error bounds from the math, layouts, edges."""

from __future__ import annotations

import pytest
import torch

from kernels.planes import (
    QuantizedGroupTensor,
    dequantize_keys,
    dequantize_values,
    kv_bytes_per_token,
    pack_nibbles,
    quantize_keys,
    quantize_values,
    unpack_nibbles,
)

# (B, n_kv, T, D, key group in tokens, value group in channels)
SHAPES = [
    (2, 1, 64, 64, 16, 32),
    (2, 2, 128, 128, 128, 128),
    (2, 8, 32, 32, 32, 16),
    (1, 2, 48, 64, 16, 64),
]


def quantize(layout: str, x: torch.Tensor, group: int) -> QuantizedGroupTensor:
    return quantize_keys(x, group) if layout == "k" else quantize_values(x, group)


def dequantize(layout: str, q: QuantizedGroupTensor, group: int, view: str) -> torch.Tensor:
    fn = dequantize_keys if layout == "k" else dequantize_values
    return fn(q, group, view)


def per_element(layout: str, meta: torch.Tensor, group: int) -> torch.Tensor:
    """Broadcast group metadata back to [B, n_kv, T, D]."""
    return meta.repeat_interleave(group, dim=2 if layout == "k" else 3)


def reference_groups(layout: str, x: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Min and scale per group, computed here independently of the module."""
    x = x.float()
    if layout == "k":  # [B, n_kv, T//G, G, D], groups over tokens
        grouped = x.unflatten(2, (x.shape[2] // group, group))
        mn, mx = grouped.amin(3), grouped.amax(3)
    else:  # [B, n_kv, T, D//G, G], groups over channels
        grouped = x.unflatten(3, (x.shape[3] // group, group))
        mn, mx = grouped.amin(4), grouped.amax(4)
    return mn, (mx - mn) / 15


def random_kv(shape, seed: int, outliers: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if outliers:  # a few channels ~20x larger (the K pattern) plus scattered spikes
        x[..., :: max(1, shape[-1] // 4)] *= 20
        spikes = torch.rand(shape, generator=gen) < 0.002
        x = torch.where(spikes, 100 * torch.randn(shape, generator=gen), x)
    return x


def fp32_eps(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float rounding allowance: a few ulps of the magnitudes involved in U*s + mn."""
    return 8 * torch.finfo(torch.float32).eps * (x.float().abs() + zero.abs() + 15 * scale)


# --- packing -----------------------------------------------------------------------------------


def test_pack_unpack_round_trip():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (3, 5, 66), generator=gen, dtype=torch.uint8)
    packed = pack_nibbles(x)
    assert packed.shape == (3, 5, 33) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), x)
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert torch.equal(packed, x[..., 0::2] + 16 * x[..., 1::2])


def test_pack_rejects_odd_dim_and_bad_values():
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(4, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_nibbles(torch.full((2, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_nibbles(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        quantize_values(torch.randn(1, 1, 4, 7), 7)


# --- error bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("layout", ["k", "v"])
@pytest.mark.parametrize("shape", SHAPES)
def test_reconstruction_bounds(shape, layout, outliers):
    B, n_kv, T, D, g_k, g_v = shape
    group = g_k if layout == "k" else g_v
    x = random_kv((B, n_kv, T, D), seed=T + D + n_kv, outliers=outliers)
    q = quantize(layout, x, group)

    assert q.upper.shape == q.lower.shape == (B, n_kv, T, D // 2)
    assert q.upper.dtype == q.lower.dtype == torch.uint8
    meta_shape = (B, n_kv, T // group, D) if layout == "k" else (B, n_kv, T, D // group)
    assert q.scale.shape == q.zero.shape == meta_shape
    assert q.scale.dtype == q.zero.dtype == torch.float32
    mn, s_ref = reference_groups(layout, x, group)
    assert torch.equal(q.zero, mn)
    torch.testing.assert_close(q.scale, s_ref, rtol=0, atol=0)

    s = per_element(layout, q.scale, group)
    zero = per_element(layout, q.zero, group)
    eps = fp32_eps(x, zero, s)
    draft = dequantize(layout, q, group, "int4")
    target = dequantize(layout, q, group, "int8")
    assert draft.dtype == target.dtype == torch.float32
    err_draft, err_target = (x - draft).abs(), (x - target).abs()

    assert (err_draft <= s / 2 + eps).all()
    # Target: s/32 wherever the lower code did not clamp; the residual's top edge (r/(s/16)
    # rounding to +8, clamped to 7) is the one place the paper's formula allows up to s/16.
    residual_code = torch.round((x - draft) / torch.where(s > 0, s / 16, 1.0))
    clamped = residual_code > 7
    assert (err_target <= s / 16 + eps).all()
    assert (err_target[~clamped] <= (s / 32 + eps)[~clamped]).all()
    assert clamped.float().mean() < 0.06  # ~1/32 expected for a near-uniform residual
    assert err_target.mean() < err_draft.mean() / 8


def test_target_error_at_top_of_residual_range():
    """Documents the clamp: with s = 1, x = 0.49 has r = 0.49 -> L = round(7.84) = 8 -> 7."""
    v = torch.tensor([0.0, 0.49, 15.0, 3.0]).reshape(1, 1, 1, 4)
    q = quantize_values(v, 4)
    target = dequantize_values(q, 4, "int8")
    assert target[0, 0, 0, 1].item() == pytest.approx(7 / 16)
    assert abs(0.49 - target[0, 0, 0, 1].item()) <= 1 / 16


# --- exactness and the lower-plane encoding ----------------------------------------------------


def grid_kv(layout: str, B, n_kv, T, D, group, seed=0) -> torch.Tensor:
    """Values mn + code * s with each group holding codes 0 and 15, s a power of two."""
    gen = torch.Generator().manual_seed(seed)
    n_groups = T // group if layout == "k" else D // group
    outer = D if layout == "k" else T
    codes = torch.randint(0, 16, (B, n_kv, outer, n_groups, group), generator=gen).float()
    codes[..., 0], codes[..., -1] = 0, 15
    codes = codes[..., torch.randperm(group, generator=gen)]
    scale = 2.0 ** torch.randint(-4, 3, (B, n_kv, outer, n_groups, 1), generator=gen).float()
    mn = torch.randint(-64, 64, (B, n_kv, outer, n_groups, 1), generator=gen).float() / 8
    x = (mn + codes * scale).flatten(-2)  # [B, n_kv, outer, T or D]
    return x.transpose(-1, -2).contiguous() if layout == "k" else x


@pytest.mark.parametrize("layout", ["k", "v"])
def test_grid_values_are_exact(layout):
    group = 16
    x = grid_kv(layout, 2, 2, 32, 64, group)
    q = quantize(layout, x, group)
    assert torch.equal(dequantize(layout, q, group, "int4"), x)
    assert torch.equal(dequantize(layout, q, group, "int8"), x)
    assert torch.equal(unpack_nibbles(q.lower), torch.full_like(x, 8, dtype=torch.uint8))


@pytest.mark.parametrize("layout", ["k", "v"])
def test_planes_hold_offset_encoded_codes(layout):
    B, n_kv, T, D, group = 2, 2, 32, 64, 16
    x = random_kv((B, n_kv, T, D), seed=7, outliers=True)
    q = quantize(layout, x, group)
    s = per_element(layout, q.scale, group)
    zero = per_element(layout, q.zero, group)
    # the formulas of design section 2, evaluated here from x and the stored metadata
    U = torch.clamp(torch.round((x - zero) / s), 0, 15)
    L = torch.clamp(torch.round((x - (U * s + zero)) / (s / 16)), -8, 7)
    assert torch.equal(unpack_nibbles(q.upper).float(), U)
    lower_nibbles = unpack_nibbles(q.lower).float()
    assert torch.equal(lower_nibbles, L + 8)  # +8 offset, not two's complement
    assert (L < 0).any() and (L == -8).any() and (L == 7).any()
    assert (lower_nibbles[L == -1] == 7).all()  # two's complement would store 15


# --- degenerate groups and invalid input -------------------------------------------------------


@pytest.mark.parametrize("layout", ["k", "v"])
def test_constant_groups_are_exact(layout):
    group = 16
    for value in (0.0, 3.25, -1e30, 1e30):
        x = torch.full((1, 2, 32, 32), value)
        q = quantize(layout, x, group)
        assert (q.scale == 0).all()
        for view in ("int4", "int8"):
            assert torch.equal(dequantize(layout, q, group, view), x)


@pytest.mark.parametrize("layout", ["k", "v"])
def test_huge_magnitudes_stay_finite(layout):
    group = 16
    x = random_kv((1, 2, 32, 32), seed=3, outliers=False) * 1e30
    x[0, 0, :16, :16] = 5e29  # constant groups among huge ones
    q = quantize(layout, x, group)
    s = per_element(layout, q.scale, group)
    eps = fp32_eps(x, per_element(layout, q.zero, group), s)
    for view, bound in (("int4", s / 2), ("int8", s / 16)):
        out = dequantize(layout, q, group, view)
        assert torch.isfinite(out).all()
        assert ((x - out).abs() <= bound + eps).all()
    assert (dequantize(layout, q, group, "int8")[0, 0, :16, :16] == 5e29).all()


def test_range_overflow_raises():
    v = torch.tensor([-3e38, 3e38]).reshape(1, 1, 1, 2)
    with pytest.raises(ValueError, match="overflows"):
        quantize_values(v)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("layout", ["k", "v"])
def test_non_finite_raises(layout, bad):
    x = torch.randn(1, 1, 16, 16)
    x[0, 0, 3, 5] = bad
    with pytest.raises(ValueError, match="inf or nan"):
        quantize(layout, x, 16)


def test_invalid_groups_and_views():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_keys(torch.randn(1, 1, 40, 32), 16)
    with pytest.raises(ValueError, match="divide head_dim"):
        quantize_values(torch.randn(1, 1, 4, 32), 12)
    with pytest.raises(ValueError, match=r"\[B, n_kv, T, D\]"):
        quantize_keys(torch.randn(4, 32), 4)
    q = quantize_keys(torch.randn(1, 1, 32, 32), 16)
    with pytest.raises(ValueError, match="view"):
        dequantize_keys(q, 16, "fp")
    with pytest.raises(ValueError, match="does not match"):
        dequantize_keys(q, 8, "int4")
    with pytest.raises(ValueError, match="view"):
        kv_bytes_per_token(64, "target")  # (the views are named by their bits, not the path)


def test_empty_key_history():
    q = quantize_keys(torch.randn(2, 2, 0, 64), 16)
    assert q.upper.shape == (2, 2, 0, 32) and q.scale.shape == (2, 2, 0, 64)
    assert dequantize_keys(q, 16, "int8").shape == (2, 2, 0, 64)


# --- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["k", "v"])
def test_half_precision_inputs(layout, dtype):
    group = 32
    x = random_kv((2, 2, 64, 64), seed=11, outliers=True).to(dtype)
    q = quantize(layout, x, group)
    assert q.scale.dtype == q.zero.dtype == torch.float32
    ref = quantize(layout, x.float(), group)
    assert torch.equal(q.upper, ref.upper) and torch.equal(q.lower, ref.lower)
    s = per_element(layout, q.scale, group)
    eps = fp32_eps(x, per_element(layout, q.zero, group), s)
    draft = dequantize(layout, q, group, "int4")
    assert draft.dtype == torch.float32
    assert ((x.float() - draft).abs() <= s / 2 + eps).all()
    target = dequantize(layout, q, group, "int8")
    assert ((x.float() - target).abs() <= s / 16 + eps).all()


# --- memory accounting -------------------------------------------------------------------------


@pytest.mark.parametrize("D,g_k,g_v", [(64, 16, 32), (128, 128, 128), (32, 32, 16)])
def test_bytes_per_token_match_tensors(D, g_k, g_v):
    B, n_kv, T = 2, 2, 128
    x = torch.randn(B, n_kv, T, D)
    qk, qv = quantize_keys(x, g_k), quantize_values(x, g_v)
    per_token = B * n_kv * T
    target = kv_bytes_per_token(D, "int8", g_k, g_v)
    assert target.total == (qk.nbytes + qv.nbytes) / per_token
    draft = kv_bytes_per_token(D, "int4", g_k, g_v)
    draft_bytes = sum(q.nbytes - q.lower.nbytes for q in (qk, qv))
    assert draft.total == draft_bytes / per_token
    assert draft.metadata == target.metadata and target.payload == 2 * draft.payload


def test_bytes_per_token_paper_setting():
    # D = G = 128: payload D/2 bytes per tensor per plane; (scale, zero) fp32 = 8 bytes per
    # 128 elements per tensor. fp16 K+V would be 512 bytes.
    assert kv_bytes_per_token(128, "int4").total == 2 * 64 + 2 * 8
    assert kv_bytes_per_token(128, "int8").total == 2 * 128 + 2 * 8
