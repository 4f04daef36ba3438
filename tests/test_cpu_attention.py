"""The CPU kernel over the hierarchical cache (`kernels/cpu/hier_attention.cpp`) against its
PyTorch twin, on the shapes and corner cases the cache produces.

Tolerance: `error_model.py`. Both are compared with a float64 attention over the same
dequantized K/V; the kernel (dequantization folded into the dot products, a polynomial exp,
-ffast-math, a summation order that follows the CPU's vector width) measured at most 3.8x
PyTorch's fp32 error over these cases (and 3 seeds) with every QSPEC_CPU_ISA variant on an
AVX-512 CPU, about 2x at the median.
"""

import pytest
import torch
from error_model import assert_within_error_model, attention64, dequantize64

from kernels.cpu import attention as cpu_attention
from kernels.triton.hier_attention import hier_attention_ref
from kernels.planes import quantize_keys, quantize_values

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler for the CPU kernel"
)


def _case(D, G, n_kv, R, T, nq, F, late=0, fp_dtype=torch.float32, chunk=512, seed=0):
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
    args = (q, kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero,
            nq + shift, fp_k, fp_v, nq, shift, pos)  # fmt: skip
    return args, chunk


CASES = [
    dict(D=64, G=64, n_kv=3, R=3, T=1, nq=640, F=100),  # SmolLM2's draft step
    dict(D=64, G=64, n_kv=3, R=3, T=5, nq=640, F=100, late=2),  # a verify, late queries
    dict(D=128, G=128, n_kv=2, R=4, T=5, nq=1024, F=200, late=1),
    dict(D=64, G=16, n_kv=1, R=2, T=3, nq=208, F=30),  # G < the kernel's block
    dict(D=80, G=16, n_kv=2, R=1, T=2, nq=96, F=20),  # head_dim not a multiple of 32
    dict(D=16, G=16, n_kv=2, R=2, T=17, nq=160, F=40, late=5),  # the tiny test models
    dict(D=64, G=64, n_kv=1, R=1, T=4, nq=0, F=60),  # no history yet
    dict(D=64, G=32, n_kv=2, R=2, T=1, nq=736, F=50, chunk=96),  # ragged last chunk
    dict(D=64, G=64, n_kv=3, R=3, T=1, nq=512, F=90, fp_dtype=torch.bfloat16),
]


FACTOR = 8  # the kernel's error may be this many times PyTorch's: 2x the worst seen


def _reference64(args, view, G):
    """The float64 attention of a case: the same planes dequantized exactly, the same fp
    region and the same per-query visibility (history < n_quant_q, fp keys in
    [fp_lo, input_pos])."""
    q, ku, kl, ks, kz, vu, vl, vs, vz, n_quant_q, fp_k, fp_v, fp_pos0, fp_lo, pos = args
    n = int(n_quant_q.max())
    keys = dequantize64(ku[:, :, :n], kl[:, :, :n], ks[:, :, : n // G], kz[:, :, : n // G],
                        G, view, keys=True)  # fmt: skip
    values = dequantize64(vu[:, :, :n], vl[:, :, :n], vs[:, :, :n], vz[:, :, :n], G, view,
                          keys=False)  # fmt: skip
    j = torch.arange(fp_k.shape[2])
    visible = torch.cat(
        (
            torch.arange(n)[None, :] < n_quant_q[:, None],
            (j[None, :] >= fp_lo[:, None]) & (fp_pos0 + j[None, :] <= pos[:, None]),
        ),
        dim=1,
    )
    keys, values = torch.cat((keys, fp_k.double()), 2), torch.cat((values, fp_v.double()), 2)
    return attention64(q, keys, values, visible)


@pytest.mark.parametrize("view", ["draft", "target"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_cpu_kernel_matches_the_twin(case, view):
    args, chunk = _case(**case)
    G = case["G"]
    want = hier_attention_ref(*args, view, G)
    got = cpu_attention.hier_attention_cpu(*args, view, G, chunk_size=chunk)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_within_error_model(got, want, _reference64(args, view, G), FACTOR, what=view)


def test_views_differ_so_the_comparison_has_teeth():
    args, _ = _case(D=64, G=64, n_kv=1, R=1, T=1, nq=256, F=70)
    draft = cpu_attention.hier_attention_cpu(*args, "draft", 64)
    target = cpu_attention.hier_attention_cpu(*args, "target", 64)
    assert (draft - target).abs().max() > 1e-3


@pytest.mark.parametrize("view", ["draft", "target"])
@pytest.mark.parametrize("D, R", [(64, 3), (128, 2)])
def test_a_query_gives_the_same_bits_alone_or_in_a_verify(view, D, R):
    """Greedy QuantSpec equals autoregressive decoding on the target path only if a verify's
    query rows come out bit for bit as they do one at a time (rows are processed in pairs)."""
    args, chunk = _case(D=D, G=64, n_kv=3, R=R, T=5, nq=640, F=100, late=2)
    q, *planes, nq_q, fp_k, fp_v, fp_pos0, fp_lo, pos = args
    together = cpu_attention.hier_attention_cpu(*args, view, 64, chunk_size=chunk)
    for t in range(5):
        one = (q[:, :, t : t + 1], *planes, nq_q[t : t + 1], fp_k, fp_v, fp_pos0)
        alone = cpu_attention.hier_attention_cpu(
            *one, fp_lo[t : t + 1], pos[t : t + 1], view, 64, chunk_size=chunk
        )
        assert torch.equal(alone, together[:, :, t : t + 1])
