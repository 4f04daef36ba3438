"""Triton kernels over the hierarchical KV cache, under the interpreter, against their twins.

conftest.py sets TRITON_INTERPRET=1 before any import, so the Triton kernels really run here.
- `hier_attention_triton` (flash-decoding over packed planes) vs `kernels.reference.
  hier_attention_ref`, and the twin itself vs float64 attention over K/V dequantized here
  element by element; the dispatcher `kernels.attention.hier_attention`;
- `quantize_keys_triton` / `quantize_values_triton` vs `kernels.planes`, bit for bit;
- `benchmarks/device_check.py --dry-run` end to end.
"""

import importlib.util
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from error_model import attention64

from kernels import attention as dispatch
from kernels.attention import hier_attention
from kernels.planes import (
    LOWER_OFFSET,
    HierLayerView,
    QueryRows,
    quantize_keys,
    quantize_values,
)
from kernels.reference import causal_attention, hier_attention_ref
from kernels.triton import hier_attention as hier
from kernels.triton import kv_pack
from kernels.triton.hier_attention import hier_attention_triton
from kernels.triton.kv_pack import (
    _launch_keys,
    _launch_values,
    quantize_keys_triton,
    quantize_values_triton,
)

REPO = Path(__file__).resolve().parent.parent
KV_VIEWS = ["int4", "int8"]


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


def build(case: Case) -> tuple[torch.Tensor, HierLayerView, QueryRows]:
    """The attention's arguments for `case` but the KV view: (q, view, rows)."""
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
    q = torch.randn(B, n_kv * case.R, case.T, D, generator=gen).to(case.q_dtype)
    view = HierLayerView(
        k_upper=kq.upper, k_lower=kq.lower, k_scale=kq.scale, k_zero=kq.zero,
        v_upper=vq.upper, v_lower=vq.lower, v_scale=vq.scale, v_zero=vq.zero,
        fp_k=fp[0, :, :, : case.F], fp_v=fp[1, :, :, : case.F], fp_pos0=case.n_quant,
        group_size=G,
    )  # fmt: skip
    rows = QueryRows(n_quant_q=case.n_quant + G * late.long(), fp_lo=G * late.long(), input_pos=pos)
    return q, view, rows


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
    _, _, rows = build(CASES["late-queries"])
    assert rows.n_quant_q.tolist() == [64, 64, 64, 96, 96]
    assert rows.fp_lo.tolist() == [0, 0, 0, 32, 32]


# ---------------------------------------------------------------------------------------------
# The twin against plain attention on explicitly dequantized K/V


def explicit_dequant(upper, lower, scale, zero, G, kv, keys):
    """Element-wise from the layout spec, independent of kernels.planes: channel d lives in
    byte d // 2, nibble d % 2 (low first); keys take metadata [s // G, d], values [s, d // G]."""
    D = 2 * upper.shape[-1]
    d = torch.arange(D)
    shift = (4 * (d % 2)).to(torch.uint8)
    u = ((upper[..., d // 2] >> shift) & 0xF).float()  # [B, n_kv, S, D]
    if keys:
        s_idx = torch.arange(upper.shape[2]) // G
        scale, zero = scale[:, :, s_idx], zero[:, :, s_idx]  # [B, n_kv, S, D]
    else:
        scale, zero = scale[..., d // G], zero[..., d // G]
    if kv == "int4":
        return u * scale + zero
    low = ((lower[..., d // 2] >> shift) & 0xF).float() - LOWER_OFFSET
    return (16 * u + low) * (scale / 16) + zero


@pytest.mark.parametrize("kv", KV_VIEWS)
@pytest.mark.parametrize("name", ["mha-t5-d128-g64-b2", "late-queries", "fp-only"])
def test_twin_matches_dense_attention(name, kv):
    """Query t sees history [0, n_quant_q[t]) then fp keys fp_lo[t]..: contiguous positions
    0, 1, .. in both cases, so float64 causal attention over that key list must agree."""
    q, v, rows = build(CASES[name])
    out = hier_attention_ref(q, v, rows, kv)
    G = v.group_size
    k_all = explicit_dequant(v.k_upper, v.k_lower, v.k_scale, v.k_zero, G, kv, True)
    v_all = explicit_dequant(v.v_upper, v.v_lower, v.v_scale, v.v_zero, G, kv, False)
    for t in range(q.shape[2]):
        n_hist, lo = int(rows.n_quant_q[t]), int(rows.fp_lo[t])
        keys = torch.cat((k_all[:, :, :n_hist], v.fp_k[:, :, lo:].float()), dim=2)
        values = torch.cat((v_all[:, :, :n_hist], v.fp_v[:, :, lo:].float()), dim=2)
        causal = torch.arange(keys.shape[2])[None, :] <= rows.input_pos[t]  # [1, S]
        want = attention64(q[:, :, t : t + 1], keys, values, causal)
        torch.testing.assert_close(
            out[:, :, t : t + 1].double(), want, rtol=1e-5, atol=1e-5, check_dtype=False
        )


def test_twin_views_differ_and_int8_is_closer():
    """Sanity of the views: INT4 and INT8 outputs differ, and the INT8 view is closer to
    attention over the unquantized keys and values."""
    case = Case(R=2, T=1, D=64, G=32, n_quant=128, F=33)
    gen = torch.Generator().manual_seed(3)
    k = keys_like(gen, 1, 1, case.S, 64)
    v = torch.randn(1, 1, case.S, 64, generator=gen)
    kq, vq = quantize_keys(k, 32), quantize_values(v, 32)
    q = torch.randn(1, 2, 1, 64, generator=gen)
    pos = torch.tensor([160])
    exact = causal_attention(q, k[:, :, :161], v[:, :, :161], pos)
    view = HierLayerView(
        kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero,
        fp_k=k[:, :, 128:161], fp_v=v[:, :, 128:161], fp_pos0=128, group_size=32,
    )  # fmt: skip
    rows = QueryRows(n_quant_q=torch.tensor([128]), fp_lo=torch.tensor([0]), input_pos=pos)
    errors = {kv: (hier_attention_ref(q, view, rows, kv) - exact).abs().max().item()
              for kv in KV_VIEWS}  # fmt: skip
    assert 0 < errors["int8"] < errors["int4"] / 4, errors


# ---------------------------------------------------------------------------------------------
# The Triton kernel (interpreter) against the twin


def assert_matches_twin(out, q, view, rows, kv):
    """fp32 output: fp32 rounding of a different summation order. bf16 output: within one
    bf16 rounding of the fp32 twin (the kernel rounds once, at the end)."""
    want = hier_attention_ref(q.float(), view, rows, kv)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    else:
        tol = want.abs() * 2.0**-8 + 1e-6
        assert ((out.float() - want).abs() <= tol).all()
        # and the twin in bf16 itself stays within the same bound
        twin = hier_attention_ref(q, view, rows, kv)
        assert ((twin.float() - want).abs() <= tol).all()


@pytest.mark.parametrize("kv", KV_VIEWS)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_twin(name, kv):
    q, view, rows = build(CASES[name])
    out = hier_attention_triton(q, view, rows, kv, chunk_size=CASES[name].chunk)
    assert_matches_twin(out, q, view, rows, kv)


@pytest.mark.parametrize("name", ["gqa3-t1-d64-g32", "late-queries", "fp-only"])
def test_kernel_soft_cap_matches_twin(name):
    """Gemma 2's attn_logit_softcapping in the kernel's base-2 scores (tanh through exp)."""
    q, view, rows = build(CASES[name])
    out = hier_attention_triton(q, view, rows, "int8", chunk_size=CASES[name].chunk, softcap=1.5)
    want = hier_attention_ref(q.float(), view, rows, "int8", softcap=1.5)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert (hier_attention_ref(q.float(), view, rows, "int8") - want).abs().max() > 1e-2


@pytest.mark.parametrize("window", [50, 20, 7])
@pytest.mark.parametrize("name", ["gqa3-t1-d64-g32", "late-queries", "mha-t5-d128-g64-b2"])
def test_kernel_sliding_window_matches_twin(name, window):
    """A local layer's window (positions > input_pos - window), cutting the history mid-tile
    or only the full-precision region."""
    q, view, rows = build(CASES[name])
    rows = replace(rows, window=window)
    out = hier_attention_triton(q, view, rows, "int8", chunk_size=CASES[name].chunk)
    assert_matches_twin(out, q, view, rows, "int8")
    whole = hier_attention_ref(q.float(), view, replace(rows, window=None), "int8")
    assert (whole - out.float()).abs().max() > 1e-2


def test_kernel_fully_masked_rows_are_zero():
    """A query before the fp region with no history sees nothing: zeros, not NaN, in both."""
    q, view, rows = build(Case(R=2, T=2, n_quant=0, F=20))
    rows = replace(rows, input_pos=torch.tensor([-1, 5]), n_quant_q=torch.tensor([0, 0]))
    for fn in (hier_attention_ref, hier_attention_triton):
        out = fn(q, view, rows, "int8")
        assert torch.isfinite(out).all()
        assert (out[:, :, 0] == 0).all() and (out[:, :, 1] != 0).any()


def test_kernel_chunk_not_multiple_of_tile_and_int32_indices():
    """chunk_size 40 rounds up to the 32-token tile (here G = 32); int32 index tensors."""
    q, view, rows = build(Case(R=2, T=3, D=64, G=32, n_quant=160, F=40))
    rows = QueryRows(rows.n_quant_q.int(), rows.fp_lo.int(), rows.input_pos.int())
    out = hier_attention_triton(q, view, rows, "int4", chunk_size=40)
    assert_matches_twin(out, q, view, rows, "int4")


def test_dispatch(monkeypatch, spy):
    """`kernels.attention.hier_attention`: the C++ kernel for CPU tensors when built (before
    the interpreter), Triton where it runs, else the twin; fused=False: always the twin."""
    q, view, rows = build(Case(R=1, T=1, n_quant=32, F=10))
    calls = spy(dispatch.cpu_attention, "hier_attention_cpu")
    spy(dispatch.triton_attention, "hier_attention_triton", calls)
    spy(dispatch, "hier_attention_ref", calls)
    if dispatch.cpu_attention.available():
        hier_attention(q, view, rows, "int4")
        assert calls == ["hier_attention_cpu"]
        calls.clear()
    monkeypatch.setattr(dispatch.cpu_attention, "available", lambda: False)
    hier_attention(q, view, rows, "int4", chunk_size=64)
    assert calls == ["hier_attention_triton"]
    calls.clear()
    want = hier_attention_ref(q, view, rows, "int4")
    assert torch.equal(hier_attention(q, view, rows, "int4", fused=False), want)
    assert calls == ["hier_attention_ref"]
    calls.clear()
    assert hier.triton_usable(q) and not hier.triton_usable(q[..., :24])  # (Triton: D = 2**k)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not hier.triton_usable(q)
    assert torch.equal(hier_attention(q, view, rows, "int4"), want)
    assert calls == ["hier_attention_ref"]


def test_bad_arguments():
    q, view, rows = build(Case(R=1, T=2, n_quant=32, F=10))
    for fn in (hier_attention_ref, hier_attention_triton):
        with pytest.raises(ValueError, match="view"):
            fn(q, view, rows, "target")  # (views are named by their bits)
        with pytest.raises(ValueError, match="fp_lo"):
            fn(q, view, replace(rows, fp_lo=torch.zeros(3)), "int4")
    with pytest.raises(ValueError, match="group size"):
        hier_attention_triton(q, replace(view, group_size=48), rows, "int4")


# ---------------------------------------------------------------------------------------------
# kv_pack: bit for bit against kernels.planes


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
def test_pack_matches_the_planes_twin(B, n_kv, T, D, G, dtype):
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
