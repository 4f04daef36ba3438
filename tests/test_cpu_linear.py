"""The few-row CPU linears (`kernels/cpu/linear.cpp`, `int_dot.cpp`) against their twins."""

import pytest
import torch
import torch.nn.functional as F

from kernels import MAX_STEP_ROWS
from kernels.cpu import build as cpu_ext
from kernels.cpu import linear as cpu_linear
from kernels.formats import quantize_int8
from qspec_core.model.transformer import Linear
from qspec_core.precision import DRAFT
from qspec_core.quant.int4 import Int4Linear
from qspec_core.runner.cpu import CpuOps

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("k, n", [(576, 1536), (64, 13), (20, 9), (1536, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(1, rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_linear.linear(x, w, b)
    assert got.shape == (1, rows, n)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k**0.5)


def test_every_output_is_written():
    """Rows of W past the last whole block of NR rows (N not a multiple of it) are computed."""
    x = torch.ones(1, 64)
    w = torch.arange(11 * 64, dtype=torch.float32).reshape(11, 64)
    got = cpu_linear.linear(x, w, None)
    torch.testing.assert_close(got, w.sum(1)[None])


def test_usable_only_for_a_steps_rows():
    assert cpu_ext.load().MAX_STEP_ROWS == MAX_STEP_ROWS  # (the C++ has it from the build)
    w = torch.randn(8, 16)
    assert cpu_linear.usable(torch.randn(3, 16), w)
    assert cpu_linear.usable(torch.randn(MAX_STEP_ROWS, 16), w)  # gamma 16's verify
    assert not cpu_linear.usable(torch.randn(MAX_STEP_ROWS + 1, 16), w)  # prefill
    assert cpu_linear.usable(torch.randn(3, 16).bfloat16(), w.bfloat16())  # any float dtype
    assert not cpu_linear.usable(torch.randn(3, 16).to(torch.float64), w)
    assert not cpu_linear.usable(torch.randn(3, 16), w.t().contiguous().t())


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("k, n, group", [(576, 192, 64), (1536, 40, 128), (128, 7, 64)])
def test_int4_rows_match_their_twin(rows, k, n, group):
    """W4A8: the kernel equals the twin (the same int8 activation rounding, then a dense
    matmul) to fp32 rounding."""
    g = torch.Generator().manual_seed(rows + k + n)
    layer = Int4Linear.from_linear(torch.nn.Linear(k, n), group)
    x = torch.randn(1, rows, k, generator=g)
    x[..., :64] = 0  # an all-zero chunk: step 0, no division by zero
    b = torch.randn(n, generator=g)
    args = (layer.packed, layer.scale, layer.zero, group, b)
    got = cpu_linear.int4_linear(x, *args)
    want = cpu_linear.int4_linear_ref(x, *args)
    assert got.shape == (1, rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("k, n", [(576, 192), (1536, 37), (64, 9)])
def test_w8a8_rows_match_their_twin(rows, k, n):
    """W8A8: the kernel equals the twin (the same int8 activation rounding, then a dense
    matmul) to fp32 rounding, bf16 activations included, for every block shape."""
    g = torch.Generator().manual_seed(rows * 31 + k + n)
    q, scale = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(1, rows, k, generator=g)
    if k > 64:
        x[..., 0, -64:] = 0  # an all-zero chunk
    b = torch.randn(n, generator=g)
    for xs in (x, x.bfloat16()):
        got = cpu_linear.w8a8_linear(xs, q, scale, b)
        want = cpu_linear.w8a8_linear_ref(xs.float(), q, scale, b).to(xs.dtype)
        assert got.shape == (1, rows, n) and got.dtype == xs.dtype
        tol = 1e-5 if xs.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    # the rounding is real: fp32 activations give a different, close result
    exact = F.linear(x, q.float() * scale[:, None], b)
    got = cpu_linear.w8a8_linear(x, q, scale, b)
    assert not torch.equal(got, exact)
    assert (got - exact).norm() < 0.02 * exact.norm()  # (about 0.6% at unit-normal inputs)


def test_int8_activations_of_tiny_and_nan_chunks_match_the_twins():
    """A chunk of activations below 1e-30 rounds to zeros (127 / max|x| would overflow to inf,
    which the prefill's twin would write into the KV); a NaN reaches the output, not hidden."""
    g = torch.Generator().manual_seed(7)
    q, scale = quantize_int8(torch.randn(16, 128, generator=g))
    layer = Int4Linear.from_linear(torch.nn.Linear(128, 16), 64)
    x = torch.randn(3, 128, generator=g)
    x[0, :64] = 1e-38
    x[1, 5] = float("nan")
    for got, want in (
        (cpu_linear.w8a8_linear(x, q, scale), cpu_linear.w8a8_linear_ref(x, q, scale)),
        (
            cpu_linear.int4_linear(x, layer.packed, layer.scale, layer.zero, 64),
            cpu_linear.int4_linear_ref(x, layer.packed, layer.scale, layer.zero, 64),
        ),
    ):
        assert want[0].isfinite().all() and want[1].isnan().all() and want[2].isfinite().all()
        assert got[1].isnan().all()
        torch.testing.assert_close(got[[0, 2]], want[[0, 2]], rtol=1e-5, atol=1e-5)


def test_w8a8_usable_needs_whole_chunks():
    q = torch.zeros(8, 128, dtype=torch.int8)
    assert cpu_linear.w8a8_usable(torch.randn(3, 128), q)
    assert not cpu_linear.w8a8_usable(torch.randn(3, 96), torch.zeros(8, 96, dtype=torch.int8))
    assert not cpu_linear.w8a8_usable(torch.randn(MAX_STEP_ROWS + 1, 128), q)


def test_int4_activation_rounding_is_small_and_has_teeth():
    """The twin's int8 activations cost at most half a step per input, and are not a no-op."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    xq = cpu_linear.quantize_activations(x)
    step = x.reshape(3, -1, 64).abs().amax(-1, keepdim=True) / 127
    assert ((xq - x).reshape(3, -1, 64).abs() <= step / 2 + 1e-7).all()
    assert not torch.equal(xq, x)


def test_int4_layer_uses_the_kernel_for_a_draft_step_only():
    """The CPU runner's ops (`qspec_core/runner/cpu.py`, which pick every linear's kernel) run
    a draft step's row on the W4A8 kernel and a prefill on the twin's own bf16 int4 kernel."""
    ops = CpuOps(cpu_ext.load())
    outer = Linear(128, 32, bias=False)
    outer.draft = layer = Int4Linear.from_linear(torch.nn.Linear(128, 32, bias=False), 64)
    step, prefill = torch.randn(1, 1, 128), torch.randn(1, 20, 128)
    with torch.no_grad():
        want = cpu_linear.int4_linear_ref(step, layer.packed, layer.scale, layer.zero, 64)
        got = ops.linear(outer, step, DRAFT)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        exact = torch.nn.functional.linear(prefill, layer.dequantized())
        got = ops.linear(outer, prefill, DRAFT)
        torch.testing.assert_close(got, exact, rtol=2e-2, atol=2e-2)  # bf16 kernel


@pytest.mark.parametrize("rows", [3, 40])  # a step's kernel; a prefill's GEMM
def test_infinite_or_nan_activations_give_nan_rows_in_every_w8a8_kernel(rows):
    """A chunk holding an infinity rounds like one holding a NaN (codes 0, a NaN step), so its
    row comes out NaN whichever kernel sums it: the GEMM once returned a finite-looking
    infinity of the wrong sign there, where the step kernels returned NaN."""
    g = torch.Generator().manual_seed(rows)
    q, scale = quantize_int8(torch.randn(16, 128, generator=g))
    x = torch.randn(rows, 128, generator=g)
    x[0, 3], x[1, 70], x[2, 5] = float("nan"), float("inf"), float("-inf")
    got = cpu_linear.w8a8_linear(x, q, scale)
    assert got[:3].isnan().all() and got[3:].isfinite().all()
    want = cpu_linear.w8a8_linear_ref(x, q, scale)
    assert want[:3].isnan().all()
    torch.testing.assert_close(got[3:], want[3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["w8a8", "int8"])
@pytest.mark.parametrize("rows", [18, 40, 257])
@pytest.mark.parametrize("out_features", [80, 83])
def test_a_prefill_through_the_row_kernels_is_bit_for_bit_its_definition(
    weights, rows, out_features, monkeypatch
):
    """With the "rows" prefill path (`runner/prefill_choice.py`), the runner runs a prefill's
    INT8-weight linears through qspec's kernels: W8A16 a slice at a time through the step
    kernel, W8A8 in one call as a GEMM. Every row equals, bit for bit, that row alone through
    the step kernel (a decode step), except W8A8 with AVX-512 VNNI, whose GEMM sums each chunk
    in one lane (`int_gemm.h`): there every row is `w8a8_prefill_ref`'s, bit for bit, and a
    decode step's to fp32 rounding. A slice that lost a row, a tile computed in another order
    or skipped (83: a partial slab), or a fallback to another kernel breaks it."""
    from qspec_core.precision import TARGET
    from qspec_core.quant.int8 import Int8Linear

    monkeypatch.setenv("QSPEC_INT8_PREFILL", "rows")
    ops = CpuOps(cpu_ext.load())  # (it asks for the prefill's path once, and keeps it)
    outer = Linear(192, out_features, bias=True)
    outer.int8 = Int8Linear.from_linear(outer)
    path = TARGET.with_weights(weights)
    x = torch.randn(1, rows, 192, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got = ops.linear(outer, x, path)
        alone = torch.cat([ops.linear(outer, x[:, i : i + 1], path) for i in range(rows)], 1)
    assert got.shape == (1, rows, out_features)
    if weights == "w8a8" and cpu_linear.prefill_lanes():
        twin = outer.int8._buffers
        args = (twin["weight_int8"], twin["weight_scale"], twin["bias"])
        assert torch.equal(got[0], cpu_linear.w8a8_prefill_ref(x[0], *args))
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    else:
        assert torch.equal(got, alone)
    monkeypatch.setenv("QSPEC_INT8_PREFILL", "int8pack")  # (the bf16 kernel: not the same bits)
    with torch.no_grad():
        assert not torch.equal(CpuOps(cpu_ext.load()).linear(outer, x, path), alone)
