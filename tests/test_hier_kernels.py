"""Triton kernels over the hierarchical KV cache, under the interpreter, against their twins.

conftest.py sets TRITON_INTERPRET=1 before any import, so `_launch` really runs Triton here.
- `hier_attention` (flash-decoding over packed planes) vs `hier_attention_ref`, and the twin
  itself vs `dense_attention` on K/V dequantized here element by element;
- `quantize_keys_triton` / `quantize_values_triton` vs `kv_quant`, bit for bit;
- `benchmarks/device_check.py --dry-run` end to end.
"""

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels.triton import hier_attention as hier
from kernels.triton import kv_pack
from kernels.triton.hier_attention import _launch, hier_attention, hier_attention_ref
from kernels.triton.kv_pack import (
    _launch_keys,
    _launch_values,
    quantize_keys_triton,
    quantize_values_triton,
)
from kernels.reference import dense_attention
from kernels.planes import LOWER_OFFSET, quantize_keys, quantize_values

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# A cache slice with known contents


@dataclass
class Case:
    """Shapes of one attention call. History [0, n_quant) is quantized in planes of capacity
    S; the fp region holds positions n_quant .. n_quant + F - 1; the T queries sit at the
    last T positions. `late`: queries past n_quant + 2G see F1 as history (the cache's rule
    max(0, (p // G - 1) * G)), i.e. n_quant_q = n_quant + G and fp_lo = G."""

    B: int = 1
    n_kv: int = 1
    R: int = 1
    T: int = 1
    D: int = 64
    G: int = 32
    n_quant: int = 64
    F: int = 40
    S: int = 256
    chunk: int | None = 64
    late: bool = False
    q_dtype: torch.dtype = torch.float32
    fp_dtype: torch.dtype = torch.float32
    seed: int = 0


def keys_like(gen, B, n_kv, S, D):
    """Keys with per-channel offsets and spreads (the outlier channels that make K grouping
    per channel)."""
    spread = 0.5 + 3 * torch.rand(D, generator=gen)
    offset = 4 * torch.randn(D, generator=gen)
    return torch.randn(B, n_kv, S, D, generator=gen) * spread + offset


def build(case: Case) -> dict:
    """hier_attention's arguments for `case`, as keywords (all but `view`)."""
    gen = torch.Generator().manual_seed(case.seed)
    B, n_kv, S, D, G = case.B, case.n_kv, case.S, case.D, case.G
    kq = quantize_keys(keys_like(gen, B, n_kv, S, D), G)  # [B, n_kv, S, D/2] planes
    vq = quantize_values(torch.randn(B, n_kv, S, D, generator=gen), G)
    # Past the valid history (and F1 for late queries), the planes hold junk and the metadata
    # NaN: a kernel that reads there turns its output into NaN.
    valid = case.n_quant + (G if case.late else 0)
    for plane in (kq.upper, kq.lower, vq.upper, vq.lower):
        plane[:, :, valid:] = 0xFF
    for meta in (kq.scale, kq.zero):
        meta[:, :, valid // G :] = float("nan")
    for meta in (vq.scale, vq.zero):
        meta[:, :, valid:] = float("nan")
    # The fp region is a prefix of a larger buffer (as in the cache), NaN past F.
    fp = torch.full((2, B, n_kv, case.F + 7, D), float("nan"))
    fp[:, :, :, : case.F] = torch.randn(2, B, n_kv, case.F, D, generator=gen)
    fp = fp.to(case.fp_dtype)
    pos = case.n_quant + case.F - case.T + torch.arange(case.T)  # [T]
    late = (pos // G - 1) * G > case.n_quant if case.late else torch.zeros(case.T, dtype=bool)
    return dict(
        q=torch.randn(B, n_kv * case.R, case.T, D, generator=gen).to(case.q_dtype),
        k_upper=kq.upper, k_lower=kq.lower, k_scale=kq.scale, k_zero=kq.zero,
        v_upper=vq.upper, v_lower=vq.lower, v_scale=vq.scale, v_zero=vq.zero,
        n_quant_q=case.n_quant + G * late.long(),
        fp_k=fp[0, :, :, : case.F], fp_v=fp[1, :, :, : case.F], fp_pos0=case.n_quant,
        fp_lo=G * late.long(), input_pos=pos, group_size=G,
    )  # fmt: skip


CASES = {
    "gqa3-t1-d64-g32": Case(n_kv=2, R=3, T=1, D=64, G=32, n_quant=160, F=40, chunk=64),
    "mha-t5-d128-g64-b2": Case(B=2, R=1, T=5, D=128, G=64, n_quant=192, F=70, chunk=128),
    "gqa3-t5-d128-g32-bf16": Case(
        R=3, T=5, D=128, G=32, n_quant=96, q_dtype=torch.bfloat16, fp_dtype=torch.bfloat16
    ),
    "fp-only": Case(n_kv=2, R=2, T=5, D=64, G=64, n_quant=0, F=70, chunk=None),
    "late-queries": Case(
        R=3, T=5, D=64, G=32, n_quant=64, F=66, late=True, fp_dtype=torch.bfloat16
    ),
    "default-chunk-g128": Case(R=3, T=1, D=128, G=128, n_quant=256, F=130, S=512, chunk=None),
}


def test_late_case_mixes_late_and_early_queries():
    """The late case must really give different n_quant_q / fp_lo within one call."""
    args = build(CASES["late-queries"])
    assert args["n_quant_q"].tolist() == [64, 64, 64, 96, 96]
    assert args["fp_lo"].tolist() == [0, 0, 0, 32, 32]


# ---------------------------------------------------------------------------------------------
# The twin against plain attention on explicitly dequantized K/V


def explicit_dequant(upper, lower, scale, zero, G, view, keys):
    """Element-wise from the layout spec, independent of kv_quant: channel d lives in byte
    d // 2, nibble d % 2 (low first); keys take metadata [s // G, d], values [s, d // G]."""
    D = 2 * upper.shape[-1]
    d = torch.arange(D)
    shift = (4 * (d % 2)).to(torch.uint8)
    u = ((upper[..., d // 2] >> shift) & 0xF).float()  # [B, n_kv, S, D]
    if keys:
        s_idx = torch.arange(upper.shape[2]) // G
        scale, zero = scale[:, :, s_idx], zero[:, :, s_idx]  # [B, n_kv, S, D]
    else:
        scale, zero = scale[..., d // G], zero[..., d // G]
    if view == "draft":
        return u * scale + zero
    low = ((lower[..., d // 2] >> shift) & 0xF).float() - LOWER_OFFSET
    return (16 * u + low) * (scale / 16) + zero


@pytest.mark.parametrize("view", ["draft", "target"])
@pytest.mark.parametrize("name", ["mha-t5-d128-g64-b2", "late-queries", "fp-only"])
def test_twin_matches_dense_attention(name, view):
    """Query t sees history [0, n_quant_q[t]) then fp keys fp_lo[t]..: contiguous positions
    0, 1, .. in both cases, so dense causal attention over that key list must agree."""
    a = build(CASES[name])
    out = hier_attention_ref(**a, view=view)
    G = a["group_size"]
    k_all = explicit_dequant(a["k_upper"], a["k_lower"], a["k_scale"], a["k_zero"], G, view, True)
    v_all = explicit_dequant(a["v_upper"], a["v_lower"], a["v_scale"], a["v_zero"], G, view, False)
    for t in range(a["q"].shape[2]):
        n_hist, lo = int(a["n_quant_q"][t]), int(a["fp_lo"][t])
        keys = torch.cat((k_all[:, :, :n_hist], a["fp_k"][:, :, lo:].float()), dim=2)
        values = torch.cat((v_all[:, :, :n_hist], a["fp_v"][:, :, lo:].float()), dim=2)
        want = dense_attention(a["q"][:, :, t : t + 1], keys, values, a["input_pos"][t : t + 1])
        torch.testing.assert_close(out[:, :, t : t + 1].float(), want, rtol=1e-5, atol=1e-5)


def test_twin_views_differ_and_target_is_closer():
    """Sanity of the views: draft and target outputs differ, and the INT8 view is closer to
    attention over the unquantized keys and values."""
    case = Case(R=2, T=1, D=64, G=32, n_quant=128, F=33)
    gen = torch.Generator().manual_seed(3)
    k = keys_like(gen, 1, 1, case.S, 64)
    v = torch.randn(1, 1, case.S, 64, generator=gen)
    kq, vq = quantize_keys(k, 32), quantize_values(v, 32)
    fp_k, fp_v = k[:, :, 128:161], v[:, :, 128:161]
    q = torch.randn(1, 2, 1, 64, generator=gen)
    pos = torch.tensor([160])
    exact = dense_attention(q, k[:, :, :161], v[:, :, :161], pos)
    errors = {}
    for view in ("draft", "target"):
        out = hier_attention_ref(
            q, kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero,
            torch.tensor([128]), fp_k, fp_v, 128, torch.tensor([0]), pos, view, 32,
        )  # fmt: skip
        errors[view] = (out - exact).abs().max().item()
    assert 0 < errors["target"] < errors["draft"] / 4, errors


# ---------------------------------------------------------------------------------------------
# The Triton kernel (interpreter) against the twin


def assert_matches_twin(out, a, view):
    """fp32 output: fp32 rounding of a different summation order. bf16 output: within one
    bf16 rounding of the fp32 twin (the kernel rounds once, at the end)."""
    want = hier_attention_ref(**{**a, "q": a["q"].float()}, view=view)
    assert out.dtype == a["q"].dtype and out.shape == a["q"].shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    else:
        tol = want.abs() * 2.0**-8 + 1e-6
        assert ((out.float() - want).abs() <= tol).all()
        # and the twin in bf16 itself stays within the same bound
        twin = hier_attention_ref(**a, view=view)
        assert ((twin.float() - want).abs() <= tol).all()


@pytest.mark.parametrize("view", ["draft", "target"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_twin(name, view):
    a = build(CASES[name])
    out = _launch(**a, view=view, chunk_size=CASES[name].chunk)
    assert_matches_twin(out, a, view)


def test_kernel_fully_masked_rows_are_zero():
    """A query before the fp region with no history sees nothing: zeros, not NaN, in both."""
    a = build(Case(R=2, T=2, n_quant=0, F=20))
    a["input_pos"] = torch.tensor([-1, 5])
    a["n_quant_q"] = torch.tensor([0, 0])
    for fn in (hier_attention_ref, _launch):
        out = fn(**a, view="target")
        assert torch.isfinite(out).all()
        assert (out[:, :, 0] == 0).all() and (out[:, :, 1] != 0).any()


def test_kernel_chunk_not_multiple_of_tile_and_int32_indices():
    """chunk_size 40 rounds up to the 32-token tile (here G = 32); int32 index tensors."""
    a = build(Case(R=2, T=3, D=64, G=32, n_quant=160, F=40))
    for key in ("n_quant_q", "fp_lo", "input_pos"):
        a[key] = a[key].int()
    out = _launch(**a, view="draft", chunk_size=40)
    assert_matches_twin(out, a, "draft")


def test_wrapper_dispatch(monkeypatch):
    a = build(Case(R=1, T=1, n_quant=32, F=10))
    calls = []
    monkeypatch.setattr(hier, "_launch", lambda *x, **k: calls.append(1) or _launch(*x, **k))
    hier_attention(**a, view="draft")
    assert calls == [1]
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(hier, "_launch", lambda *x, **k: pytest.fail("Triton ran on CPU"))
    assert not hier.triton_usable(a["q"])
    assert torch.equal(hier_attention(**a, view="draft"), hier_attention_ref(**a, view="draft"))


def test_bad_arguments():
    a = build(Case(R=1, T=2, n_quant=32, F=10))
    with pytest.raises(ValueError, match="view"):
        hier_attention_ref(**a, view="int8")
    with pytest.raises(ValueError, match="fp_lo"):
        hier_attention_ref(**{**a, "fp_lo": torch.zeros(3)}, view="draft")
    with pytest.raises(ValueError, match="group size"):
        _launch(**{**a, "group_size": 48}, view="draft")


# ---------------------------------------------------------------------------------------------
# kv_pack: bit for bit against kv_quant


def assert_same_quantization(got, want):
    for name in ("upper", "lower", "scale", "zero"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs in {(a != b).sum().item()} places"


PACK_SHAPES = [  # (B, n_kv, T, D, G)
    (1, 2, 64, 64, 32),
    (2, 1, 128, 128, 128),
    (1, 1, 96, 128, 32),
    (1, 1, 128, 128, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,n_kv,T,D,G", PACK_SHAPES)
def test_pack_matches_kv_quant(B, n_kv, T, D, G, dtype):
    gen = torch.Generator().manual_seed(T + D + G)
    k = keys_like(gen, B, n_kv, T, D).to(dtype)
    v = (torch.randn(B, n_kv, T, D, generator=gen) * 2).to(dtype)
    assert_same_quantization(_launch_keys(k, G), quantize_keys(k, G))
    assert_same_quantization(_launch_values(v, G), quantize_values(v, G))


def test_pack_rounds_half_to_even_and_zero_range_groups():
    """Exact ties in both planes (s = 1: x = 2.5 is an upper tie, 2 + 1/32 and 2 + 3/32 are
    lower ties) and constant groups (s = 0) along with ordinary ones."""
    ties = torch.tensor([0.0, 15.0, 2.5, 3.5, 2 + 1 / 32, 2 + 3 / 32, 5 - 1 / 32, 0.5])
    group = ties.repeat(4)  # 32 values, min 0, max 15
    k = torch.stack([group, torch.full((32,), 1.25), group.flip(0), group * 0.5], dim=1)
    k = k.repeat(1, 16).reshape(1, 1, 32, 64)  # every key channel: ties or constant
    v = k.transpose(2, 3).contiguous()  # every value group: ties or constant
    assert_same_quantization(_launch_keys(k, 32), quantize_keys(k, 32))
    assert_same_quantization(_launch_values(v, 32), quantize_values(v, 32))
    assert_same_quantization(_launch_values(v, None), quantize_values(v, None))


def test_pack_strided_input_like_a_rotation():
    """The rotation quantizes fp_k[layer, :, :, :G], a strided slice of the fp buffer."""
    buffer = torch.randn(2, 1, 2, 96, 64, generator=torch.Generator().manual_seed(5))
    f1 = buffer[1, :, :, :32]
    assert not f1.is_contiguous()
    assert_same_quantization(_launch_keys(f1, 32), quantize_keys(f1, 32))
    assert_same_quantization(_launch_values(f1, 32), quantize_values(f1, 32))


def test_pack_wrappers_dispatch(monkeypatch):
    k = torch.randn(1, 1, 32, 64)
    calls = []
    monkeypatch.setattr(kv_pack, "_launch_values", lambda *a: calls.append(1) or _launch_values(*a))
    assert_same_quantization(quantize_values_triton(k), quantize_values(k))
    assert calls == [1]
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(kv_pack, "_launch_keys", lambda *a: pytest.fail("Triton ran on CPU"))
    assert_same_quantization(quantize_keys_triton(k, 32), quantize_keys(k, 32))
    with pytest.raises(ValueError, match="multiple"):
        _launch_keys(torch.randn(1, 1, 33, 64), 32)


# ---------------------------------------------------------------------------------------------
# The GPU check script, dry-run on CPU


def test_device_check_dry_run(tmp_path, monkeypatch):
    """The whole script in-process at tiny shapes (about 10 s): every section, no errors."""
    spec = importlib.util.spec_from_file_location(
        "device_check", REPO / "benchmarks" / "device_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "device_check", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    module.main(["--dry-run", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "device_check.json").read_text())
    for key in ("env", "correctness", "attention", "w4a16", "kv_pack", "model_step", "errors"):
        assert key in report, key
    assert report["errors"] == [], report["errors"]
    assert report["correctness"] and all(item["ok"] for item in report["correctness"])
    assert {"draft", "target", "sdpa_bf16", "dequant_sdpa"} <= set(report["attention"][0]["ms"])
    speedups = report["model_step"]["projected_speedup"]  # {"L=..,n_kv=..": speedup}
    assert speedups and all(value > 0 for value in speedups.values())
    assert report["model_step"]["tokens_per_round"] == pytest.approx((1 - 0.58**5) / 0.42)
    assert (tmp_path / "device_check.md").read_text().startswith("# ")
