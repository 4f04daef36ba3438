"""The CPU kernel over the hierarchical cache (`kernels/cpu/hier_attention.cpp`) against its
PyTorch twin (`kernels.reference.hier_attention_ref`), on the shapes and corner cases the
cache produces.

Tolerance: `error_model.py`. Both are compared with a float64 attention over the same
dequantized K/V; the kernel (dequantization folded into the dot products, a polynomial exp,
-ffast-math, a summation order that follows the CPU's vector width) measured at most 3.8x
PyTorch's fp32 error over these cases (and 3 seeds) with every QSPEC_CPU_ISA variant on an
AVX-512 CPU, about 2x at the median.
"""

import dataclasses

import pytest
import torch
from error_model import assert_within_error_model, hier_attention64

from kernels.cpu import attention as cpu_attention
from kernels.planes import HierLayerView, QueryRows, quantize_keys, quantize_values
from kernels.reference import hier_attention_ref

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler for the CPU kernel"
)
KV_VIEWS = ["int4", "int8"]


def _case(D, G, n_kv, R, T, nq, F, late=0, fp_dtype=torch.float32, chunk=512, seed=0):
    """(q, view, rows, chunk) of one case."""
    g = torch.Generator().manual_seed(seed)
    S = nq + 3 * G  # capacity beyond the valid history holds junk the kernel must not read
    k = torch.randn(1, n_kv, S, D, generator=g) * 3 + 1
    v = torch.randn(1, n_kv, S, D, generator=g)
    kq, vq = quantize_keys(k, G), quantize_values(v, G)
    q = torch.randn(1, n_kv * R, T, D, generator=g)
    fp_k = torch.randn(1, n_kv, F + 7, D, generator=g).to(fp_dtype)[:, :, :F]  # a strided slice
    fp_v = torch.randn(1, n_kv, F + 7, D, generator=g).to(fp_dtype)[:, :, :F]
    pos = torch.arange(nq + F - T, nq + F)
    shift = torch.zeros(T, dtype=torch.long)
    if late:
        shift[-late:] = G  # late queries: one more group quantized, hidden in the fp region
    view = HierLayerView(kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale,
                         vq.zero, fp_k, fp_v, fp_pos0=nq, group_size=G)  # fmt: skip
    return q, view, QueryRows(n_quant_q=nq + shift, fp_lo=shift, input_pos=pos), chunk


CASES = [
    dict(D=64, G=64, n_kv=3, R=3, T=1, nq=640, F=100),  # SmolLM2's draft step
    dict(D=64, G=64, n_kv=3, R=3, T=5, nq=640, F=100, late=2),  # a verify, late queries
    dict(D=128, G=128, n_kv=2, R=4, T=5, nq=1024, F=200, late=1),
    dict(D=64, G=16, n_kv=1, R=2, T=3, nq=208, F=30),  # G < the kernel's block
    dict(D=80, G=16, n_kv=2, R=1, T=2, nq=96, F=20),  # head_dim not a multiple of 32
    dict(D=80, G=80, n_kv=1, R=2, T=3, nq=240, F=90),  # G above 32, not a multiple of it
    dict(D=16, G=16, n_kv=2, R=2, T=17, nq=160, F=40, late=5),  # the tiny test models
    dict(D=64, G=64, n_kv=1, R=1, T=4, nq=0, F=60),  # no history yet
    dict(D=64, G=32, n_kv=2, R=2, T=1, nq=736, F=50, chunk=96),  # ragged last chunk
    dict(D=64, G=64, n_kv=3, R=3, T=1, nq=512, F=90, fp_dtype=torch.bfloat16),
]


FACTOR = 8  # the kernel's error may be this many times PyTorch's: 2x the worst seen


@pytest.mark.parametrize("int_queries", [False, True], ids=["fp32-q", "int-q"])
@pytest.mark.parametrize("kv", KV_VIEWS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_cpu_kernel_matches_the_twin(case, kv, int_queries):
    q, view, rows, chunk = _case(**case)
    want = hier_attention_ref(q, view, rows, kv, int_queries=int_queries)
    got = cpu_attention.hier_attention_cpu(q, view, rows, kv, chunk, int_queries)
    assert got.dtype == want.dtype and got.shape == want.shape
    exact = hier_attention64(q, view, rows, kv, int_queries)
    assert_within_error_model(got, want, exact, FACTOR, what=kv)


@pytest.mark.parametrize("kv", KV_VIEWS)
def test_int_queries_are_rounded_and_only_on_the_history(kv):
    """The rounding changes the history's scores by about a code step and leaves a query that
    sees only the full-precision region (no history yet) bit for bit as it was."""
    q, view, rows, _ = _case(D=64, G=64, n_kv=1, R=2, T=2, nq=256, F=70)
    fp_q = cpu_attention.hier_attention_cpu(q, view, rows, kv)
    int8_q = cpu_attention.hier_attention_cpu(q, view, rows, kv, None, True)
    assert not torch.equal(fp_q, int8_q) and (fp_q - int8_q).abs().max() < 0.3
    q, view, rows, _ = _case(D=64, G=64, n_kv=1, R=1, T=4, nq=0, F=60)
    assert torch.equal(
        cpu_attention.hier_attention_cpu(q, view, rows, kv),
        cpu_attention.hier_attention_cpu(q, view, rows, kv, None, True),
    )


def test_views_differ_so_the_comparison_has_teeth():
    q, view, rows, _ = _case(D=64, G=64, n_kv=1, R=1, T=1, nq=256, F=70)
    int4 = cpu_attention.hier_attention_cpu(q, view, rows, "int4")
    int8 = cpu_attention.hier_attention_cpu(q, view, rows, "int8")
    assert (int4 - int8).abs().max() > 1e-3
    with pytest.raises(ValueError, match="view"):
        cpu_attention.hier_attention_cpu(q, view, rows, "target")  # (not silently INT4)


SOFTCAP_CASES = [CASES[1], CASES[2], CASES[4], CASES[6]]  # vector D 64/128, portable 80/16


@pytest.mark.parametrize("int_queries", [False, True], ids=["fp32-q", "int-q"])
@pytest.mark.parametrize("kv", KV_VIEWS)
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: f"D{c['D']}-T{c['T']}")
def test_soft_capped_scores_match_the_twin(case, kv, int_queries):
    """Gemma 2's attn_logit_softcapping: cap * tanh(s / cap) on the scaled scores of the
    history and the full-precision region, before any key is hidden (a hidden key is never
    -cap). These scores reach +-4, so a cap of 2 bends them: without it the outputs move."""
    q, view, rows, chunk = _case(**case)
    want = hier_attention_ref(q, view, rows, kv, int_queries=int_queries, softcap=2.0)
    got = cpu_attention.hier_attention_cpu(q, view, rows, kv, chunk, int_queries, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    uncapped = hier_attention_ref(q, view, rows, kv, int_queries=int_queries)
    assert (uncapped - want).abs().max() > 0.05


@pytest.mark.parametrize("int_queries", [False, True], ids=["fp32-q", "int-q"])
@pytest.mark.parametrize("kv", KV_VIEWS)
@pytest.mark.parametrize("D, R", [(64, 3), (128, 2)])
def test_a_query_gives_the_same_bits_alone_or_in_a_verify(kv, D, R, int_queries):
    """Greedy QuantSpec equals autoregressive decoding on the target path only if a verify's
    query rows come out bit for bit as they do one at a time (rows are processed in pairs)."""
    q, view, rows, chunk = _case(D=D, G=64, n_kv=3, R=R, T=5, nq=640, F=100, late=2)
    for cap in (None, 2.0):  # (a soft cap too: Gemma 2)
        together = cpu_attention.hier_attention_cpu(q, view, rows, kv, chunk, int_queries, cap)
        for t in range(5):
            one = QueryRows(
                rows.n_quant_q[t : t + 1], rows.fp_lo[t : t + 1], rows.input_pos[t : t + 1]
            )
            alone = cpu_attention.hier_attention_cpu(
                q[:, :, t : t + 1], view, one, kv, chunk, int_queries, cap
            )
            assert torch.equal(alone, together[:, :, t : t + 1])


# a local layer's sliding window, cutting: mid-block in the history, at the history's end, in
# the full-precision region (a verify's oldest row sees history there, its newest none), and
# nowhere (longer than the context)
WINDOWS = [300, 100, 37, 5000]


def _windowed(case: dict, window: int):
    q, view, rows, chunk = _case(**case)
    return q, view, dataclasses.replace(rows, window=window), chunk


@pytest.mark.parametrize("int_queries", [False, True], ids=["fp32-q", "int-q"])
@pytest.mark.parametrize("kv", KV_VIEWS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=lambda c: f"D{c['D']}")
def test_a_sliding_window_matches_the_twin(case, window, kv, int_queries):
    """Each query sees its last `window` positions only (transformers' sliding_window), in
    the history (a block cut mid-way), the region or both; the vector paths (D 64, 128) and
    the portable one (D 80). A window longer than the context changes no bit."""
    q, view, rows, chunk = _windowed(case, window)
    want = hier_attention_ref(q, view, rows, kv, int_queries=int_queries)
    got = cpu_attention.hier_attention_cpu(q, view, rows, kv, chunk, int_queries)
    assert_within_error_model(got, want, hier_attention64(q, view, rows, kv, int_queries), FACTOR)
    unbounded = dataclasses.replace(rows, window=None)
    everything = cpu_attention.hier_attention_cpu(q, view, unbounded, kv, chunk, int_queries)
    if window > int(rows.input_pos.max()):
        assert torch.equal(got, everything)
    else:
        assert (got - everything).abs().max() > 1e-2


@pytest.mark.parametrize("window", WINDOWS[:3])
def test_a_windowed_query_gives_the_same_bits_alone_or_in_a_verify(window):
    q, view, rows, chunk = _windowed(dict(D=64, G=64, n_kv=3, R=3, T=5, nq=640, F=100, late=2),
                                     window)  # fmt: skip
    for iq in (False, True):
        together = cpu_attention.hier_attention_cpu(q, view, rows, "int8", chunk, iq)
        for t in range(5):
            one = QueryRows(
                rows.n_quant_q[t : t + 1], rows.fp_lo[t : t + 1], rows.input_pos[t : t + 1],
                window=window,
            )  # fmt: skip
            alone = cpu_attention.hier_attention_cpu(q[:, :, t : t + 1], view, one, "int8",
                                                     chunk, iq)  # fmt: skip
            assert torch.equal(alone, together[:, :, t : t + 1])


def test_int_queries_never_go_to_triton_and_refuse_heads_too_wide(monkeypatch):
    """The Triton kernel has no integer queries, so such a call takes the C++ kernel or the
    reference; a head wider than 256 dims would overflow the int32 dots, and is refused."""
    from kernels import attention as dispatch

    monkeypatch.setattr(dispatch.cpu_attention, "available", lambda: False)
    monkeypatch.setattr(dispatch.triton_attention, "triton_usable", lambda q: True)
    q = torch.zeros(1, 2, 1, 64)
    assert dispatch.backend(q) == "triton"
    assert dispatch.backend(q, True, True) == "reference"
    q, view, rows, _ = _case(D=288, G=32, n_kv=1, R=1, T=1, nq=64, F=10)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        hier_attention_ref(q, view, rows, "int8", int_queries=True)
    with pytest.raises(RuntimeError, match="head_dim <= 256"):
        cpu_attention.hier_attention_cpu(q, view, rows, "int8", None, True)
