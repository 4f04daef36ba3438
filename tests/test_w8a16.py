"""W8A16: per-channel INT8 quantization (`kernels/formats.py`), the PyTorch twin, the Triton
kernel under the interpreter, and the CPU paths of an INT8 linear: qspec's batch-invariant
kernel for a step's rows (at most `MAX_STEP_ROWS`, chosen by the CPU runner), torch's
int8 kernel for more (prefill, `Int8Linear.forward`).

conftest.py sets TRITON_INTERPRET=1 before any import, so `_launch` really runs Triton here.
"""

import json

import pytest
import torch
from conftest import fresh_machine_choice
from safetensors.torch import load_file, save_file
from torch import nn

from kernels import MAX_STEP_ROWS
from kernels.cpu import build as cpu_ext
from kernels.formats import dequantize_int8, quantize_activations, quantize_int8
from kernels.triton import w8a16
from kernels.triton.w8a16 import _launch, w8a16_matmul, w8a16_ref
from qspec_core.errors import QspecError
from qspec_core.model.transformer import Linear
from qspec_core.precision import W8
from qspec_core.quant import int8 as int8_linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.runner import prefill_choice
from qspec_core.runner.cpu import CpuOps
from qspec_core.runner.reference import TorchOps

BF16_U = 2.0**-9  # unit roundoff of bf16 (8 significant bits, round to nearest)


def make_layer(k, n, bias=True, seed=0) -> Int8Linear:
    """An Int8Linear quantized from a random nn.Linear [K -> N] (weights ~ 0.02 like an LLM's)."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return Int8Linear.from_linear(linear)


def fp64_reference(x, layer: Int8Linear):
    """Dequantized weight times x, all in fp64, independent of w8a16_ref."""
    weight = layer.weight_int8.double() * layer.weight_scale.double()[:, None]  # [N, K]
    y = x.double() @ weight.T
    return y if layer.bias is None else y + layer.bias.double()


def magnitude(x, layer: Int8Linear):
    """|x| @ |W|^T [..., N]: the scale of the rounding error of any dot product with W."""
    return x.double().abs() @ layer.dequantized_weight().double().abs().T


@pytest.fixture
def op_calls(monkeypatch):
    """Count calls of torch._weight_int8pack_mm, so a silent fallback to the twin can't pass.
    (Many-row products take it whatever this machine measured: `runner/prefill_choice.py`.)"""
    monkeypatch.setenv(prefill_choice.ENV, "int8pack")
    real = torch._weight_int8pack_mm
    calls = []

    def spy(x, w, scales):
        calls.append((tuple(x.shape), x.dtype, scales.dtype))
        return real(x, w, scales)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", spy)
    return calls


# ---------------------------------------------------------------------------------------------
# Quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(1, 1), (40, 96), (1536, 576), (7, 33)])
def test_quantize_round_trip_bound(n, k, dtype):
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).to(dtype)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == (n, k) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (n,)
    w = weight.float()
    torch.testing.assert_close(scale, w.abs().amax(1) / 127, rtol=0, atol=0)
    assert int(q.abs().max()) <= 127
    assert bool((q.abs().amax(1) == 127).all())  # every row uses the whole grid
    err = (w - dequantize_int8(q, scale)).abs()  # [N, K]
    # |w - q s| <= s / 2, up to the fp32 rounding of w / s and of q * s
    assert bool((err <= scale[:, None] * (0.5 + 1e-5)).all()), float((err / scale[:, None]).max())


def test_quantize_zero_and_tiny_rows():
    weight = torch.randn(4, 64)
    weight[1] = 0.0
    weight[3] = 0.0
    weight[3, 5] = 1e-44  # subnormal: max / 127 underflows to 0
    q, scale = quantize_int8(weight)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    assert scale[1] == 1.0 and bool((q[1] == 0).all())
    deq = dequantize_int8(q, scale)
    assert bool((deq[1] == 0).all()) and bool(torch.isfinite(deq).all())
    assert float((deq[3] - weight[3]).abs().max()) <= 1e-44
    err = (weight - deq).abs()
    assert bool((err[[0, 2]] <= scale[[0, 2], None] * (0.5 + 1e-5)).all())


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="float"):
        quantize_int8(torch.ones(3))
    with pytest.raises(ValueError, match="float"):
        quantize_int8(torch.ones(2, 3, dtype=torch.int8))


# ---------------------------------------------------------------------------------------------
# The PyTorch twin


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_ref_matches_fp64(bias):
    layer = make_layer(96, 40, bias=bias)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1))
    y = w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias)
    assert y.shape == (2, 5, 40) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), fp64_reference(x, layer), rtol=1e-5, atol=1e-5)


def test_ref_rejects_bad_shapes():
    q, scale = quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="int8"):
        w8a16_ref(torch.randn(1, 64), q.to(torch.int16), scale)
    with pytest.raises(ValueError, match="K"):
        w8a16_ref(torch.randn(1, 32), q, scale)
    with pytest.raises(ValueError, match="scale"):
        w8a16_ref(torch.randn(1, 64), q, scale[:4])
    with pytest.raises(ValueError, match="bias"):
        w8a16_ref(torch.randn(1, 64), q, scale, torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# Int8Linear on CPU: a step's rows through qspec's kernel, more through torch's int8 kernel
PREFILL_ROWS = MAX_STEP_ROWS + 7  # past the step kernel: torch's int8 kernel


@pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 5, MAX_STEP_ROWS])
def test_cpu_step_rows_use_the_fp32_kernel(m, dtype, op_calls):
    """A decode or verify step: fp32 activations (bf16 ones upcast exactly), fp32 sums, so the
    error vs the fp64 dequantized product is fp32 rounding: <= (K + 2) u32 (|x| @ |W|^T),
    plus the final rounding to x.dtype."""
    k, n = 576, 96
    layer = make_layer(k, n, bias=True, seed=m)
    outer = Linear(k, n, bias=True)  # the model's linear; the CPU runner picks the kernel
    outer.int8 = layer
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    with torch.no_grad():
        y = CpuOps(cpu_ext.load()).linear(outer, x, W8)
    assert y.shape == (m, n) and y.dtype == dtype and op_calls == []
    exact = fp64_reference(x, layer)
    out_u = 2.0**-24 if dtype == torch.float32 else 2.0**-8  # half an ulp of the output
    bound = (k + 2) * 2.0**-24 * magnitude(x, layer) + out_u * exact.abs() + 1e-12
    assert bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(576, 1536), (96, 40)])
@pytest.mark.parametrize("m", [PREFILL_ROWS, 64])
def test_cpu_path_vs_dequantize_then_matmul(m, k, n, dtype, op_calls):
    """Elementwise bound from the module docstring: the bf16 rounding of x (fp32 inputs) and
    of the kernel's unscaled sum, each <= 2^-9 * (|x| @ |W|^T)."""
    layer = make_layer(k, n, bias=True, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = layer(x)
    assert y.shape == (m, n) and y.dtype == dtype
    assert op_calls == [((m, k), torch.bfloat16, torch.bfloat16)]  # the int8 kernel ran, once

    ref = w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias)  # fp32 math, x.dtype
    bound = (2 * BF16_U if dtype == torch.float32 else 3 * BF16_U) * magnitude(x, layer)
    err = (y.double() - ref.double()).abs()
    assert bool((err <= bound * (1 + 1e-3) + 1e-6).all()), float((err / bound).max())
    # and the bound is not vacuous: the typical error is well inside it
    assert float((err / bound).median()) < 0.5


def test_cpu_path_leading_dims_and_no_bias(op_calls):
    layer = make_layer(96, 40, bias=False)
    x = torch.randn(2, PREFILL_ROWS, 96, generator=torch.Generator().manual_seed(3))
    y = layer(x)
    assert y.shape == (2, PREFILL_ROWS, 40) and len(op_calls) == 1
    err = (y.double() - fp64_reference(x, layer)).abs()
    assert bool((err <= 2 * BF16_U * magnitude(x, layer) * (1 + 1e-3) + 1e-6).all())


def test_cpu_path_misaligned_bf16_view(op_calls):
    """A bf16 view at an odd offset: the kernel's aligned row loads would fault on it (M > 1),
    so the layer must hand it an aligned copy."""
    layer = make_layer(64, 40)
    rows = PREFILL_ROWS
    buffer = torch.randn(rows * 64 + 1, generator=torch.Generator().manual_seed(4)).bfloat16()
    x = buffer[1:].view(rows, 64)  # data_ptr % 64 == 2
    assert x.data_ptr() % 64 != 0
    y = layer(x)
    assert len(op_calls) == 1
    err = (y.double() - fp64_reference(x, layer)).abs()
    assert bool((err <= 3 * BF16_U * magnitude(x, layer) * (1 + 1e-3) + 1e-6).all())


@pytest.mark.parametrize("k", [100, 40, 8])  # not multiples of 16: the kernel reads past rows
def test_cpu_path_falls_back_for_unsupported_k(k, op_calls):
    layer = make_layer(k, 24)
    x = torch.randn(PREFILL_ROWS, k, generator=torch.Generator().manual_seed(k))
    assert not layer.cpu_kernel_ok()
    y = layer(x)
    assert op_calls == []
    assert torch.equal(y, w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias))


def test_cpu_path_falls_back_without_the_op(monkeypatch, op_calls):
    layer = make_layer(96, 40)
    x = torch.randn(PREFILL_ROWS, 96)
    ref = w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias)
    monkeypatch.setattr(int8_linear, "_HAS_CPU_OP", False)
    assert torch.equal(layer(x), ref) and op_calls == []
    monkeypatch.setattr(int8_linear, "_HAS_CPU_OP", True)

    def broken(*args):
        raise RuntimeError("unsupported")

    monkeypatch.setattr(torch, "_weight_int8pack_mm", broken)
    assert torch.equal(layer(x), ref)
    assert layer(torch.randn(0, 96)).shape == (0, 40)


def test_from_linear_close_to_the_float_layer():
    """Int8Linear vs the nn.Linear it came from: the rounding of W (<= scale / 2 per entry)
    plus the CPU kernel's bf16 rounding."""
    linear = nn.Linear(576, 1536)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = linear(x).double()
    quant_bound = x.double().abs().sum(-1, keepdim=True) * layer.weight_scale.double() / 2
    bound = quant_bound + 2 * BF16_U * magnitude(x, layer)
    err = (layer(x).double() - exact).abs()
    assert bool((err <= bound * (1 + 1e-3) + 1e-6).all())
    assert layer.dequantized_weight().shape == (1536, 576)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_state_dict_safetensors_round_trip(tmp_path, bias):
    layer = make_layer(96, 40, bias=bias)
    state = layer.state_dict()
    assert set(state) == (
        {"weight_int8", "weight_scale", "bias"} if bias else {"weight_int8", "weight_scale"}
    )
    assert state["weight_int8"].dtype == torch.int8 and state["weight_scale"].dtype == torch.float32
    save_file(dict(state), tmp_path / "layer.safetensors")
    loaded = Int8Linear(96, 40, bias=bias)
    loaded.load_state_dict(load_file(tmp_path / "layer.safetensors"))
    x = torch.randn(3, 96)
    assert torch.equal(loaded.weight_int8, layer.weight_int8)
    assert torch.equal(loaded(x), layer(x))


# ---------------------------------------------------------------------------------------------
# The Triton kernel (interpreter) against the twin, FlagAttention style


def assert_kernel_close(x, layer: Int8Linear):
    """max|triton - fp64| <= 2 * max|ref in x.dtype - fp64| + eps."""
    exact = fp64_reference(x, layer)
    ref = w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias)
    out = _launch(x, layer.weight_int8, layer.weight_scale, layer.bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    ref_err = (ref.double() - exact).abs().max().item()
    out_err = (out.double() - exact).abs().max().item()
    eps = 1e-6 * (1.0 + exact.abs().max().item())
    assert out_err <= 2 * ref_err + eps, f"triton err {out_err:.3g} vs ref err {ref_err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", [(96, 40), (200, 64)])  # K tails inside one and two K-blocks
@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_matches_reference(m, k, n, bias, dtype):
    layer = make_layer(k, n, bias=bias, seed=m * 1000 + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).to(dtype)
    assert_kernel_close(x, layer)


def test_kernel_odd_operands():
    """Leading dims, a strided x over several M tiles, fp16, K < 16, N = 1."""
    layer = make_layer(64, 20, seed=7)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert_kernel_close(x, layer)  # [2, 3, K]
    wide = torch.randn(64, 70, generator=torch.Generator().manual_seed(8))
    assert_kernel_close(wide.T, layer)  # x [70, K] with stride (1, 70): 2 M tiles
    assert_kernel_close(torch.randn(4, 64).half(), layer)
    assert_kernel_close(torch.randn(3, 8), make_layer(8, 1, seed=9))


# ---------------------------------------------------------------------------------------------
# The wrapper's dispatch


def test_wrapper_runs_triton_under_interpreter(monkeypatch, spy):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = spy(w8a16, "_launch")
    layer = make_layer(96, 40)
    x = torch.randn(3, 96)
    y = w8a16_matmul(x, layer.weight_int8, layer.weight_scale, layer.bias)
    assert calls == ["_launch"]
    torch.testing.assert_close(y, w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wrapper_falls_back_on_cpu(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(w8a16, "_launch", lambda *a: pytest.fail("Triton ran without a driver"))
    layer = make_layer(96, 40)
    x = torch.randn(2, 4, 96).to(dtype)
    assert not w8a16.triton_usable(x)
    y = w8a16_matmul(x, layer.weight_int8, layer.weight_scale, layer.bias)
    assert torch.equal(y, w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias))


@pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")
@pytest.mark.parametrize("m", [1, 5, PREFILL_ROWS])
def test_w8a8_rows_and_prefill_round_the_activations_alike(m, op_calls):
    """W8A8 (the CPU default target): a step's rows run the integer-dot kernel, a prefill the
    same activation rounding then the int8 weight kernel; both within bf16 rounding of
    `quantize_activations` then dequantize-then-matmul, and visibly not W8A16."""

    k, n = 576, 96
    layer = make_layer(k, n, bias=True, seed=m)
    outer = Linear(k, n, bias=True)
    outer.int8 = layer
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    with torch.no_grad():
        y = CpuOps(cpu_ext.load()).linear(outer, x, W8.with_weights("w8a8"))
        ref = w8a16_ref(quantize_activations(x), layer.weight_int8, layer.weight_scale, layer.bias)
        w8a16 = w8a16_ref(x, layer.weight_int8, layer.weight_scale, layer.bias)
    assert (op_calls == []) == (m <= MAX_STEP_ROWS)  # the step kernel; else PyTorch's
    bound = 2 * BF16_U * magnitude(x, layer) if m > MAX_STEP_ROWS else 1e-4
    assert bool(((y.double() - ref.double()).abs() <= bound).all())
    if m <= MAX_STEP_ROWS:  # (a prefill's bf16 rounding is of the activations' size)
        assert (y - w8a16).abs().max() > 10 * (y - ref).abs().max()


def test_w8a8_needs_whole_64_input_chunks():
    """A model has the w8a8 weight set only when every linear's inputs are whole 64-input
    chunks (the activation steps); otherwise a forward on it is refused, not approximated."""
    from hf_tiny import ours_from_hf, tiny_hf

    from qspec_core.model.transformer import attach_int8, linear_layers

    for inter, ok in ((192, True), (96, False)):
        model = ours_from_hf(tiny_hf("llama", hidden_size=128, intermediate_size=inter))
        layers = linear_layers(model)
        attach_int8(model, {name: Int8Linear.from_linear(m) for name, m in layers.items()})
        assert "int8" in model.weight_sets and ("w8a8" in model.weight_sets) == ok


# ---------------------------------------------------------------------------------------------
# The many-row (prefill) path, chosen by measurement once per machine


@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    """An empty qspec cache, no override, no choice remembered by this process."""
    yield from fresh_machine_choice(prefill_choice, monkeypatch, tmp_path)


def test_prefill_path_is_measured_once_and_kept_per_machine(fresh_choice, monkeypatch):
    timings = iter([{"int8pack": 2.0, "fp32": 1.0}, {"int8pack": 1.0, "fp32": 2.0}])
    calls = []
    monkeypatch.setattr(prefill_choice, "measure", lambda: calls.append(1) or next(timings))
    assert prefill_choice.prefill_path() == "fp32"
    kept = json.loads((fresh_choice / prefill_choice.FILE).read_text())
    assert kept[prefill_choice.machine_key()]["path"] == "fp32"
    prefill_choice._measured_choice.cache_clear()  # a later process: reads, never re-measures
    assert prefill_choice.prefill_path() == "fp32" and len(calls) == 1
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another key: measured anew
    assert prefill_choice.prefill_path() == "int8pack" and len(calls) == 2


def test_prefill_path_override_and_bad_values(fresh_choice, monkeypatch):
    monkeypatch.setattr(prefill_choice, "measure", lambda: pytest.fail("measured"))
    for value in ("fp32", "int8pack", " FP32 "):
        monkeypatch.setenv(prefill_choice.ENV, value)
        assert prefill_choice.prefill_path() == value.strip().lower()
    monkeypatch.setenv(prefill_choice.ENV, "bf16")
    with pytest.raises(QspecError, match="QSPEC_INT8_PREFILL"):
        prefill_choice.prefill_path()


def test_a_damaged_choice_file_is_measured_over(fresh_choice, monkeypatch):
    (fresh_choice / prefill_choice.FILE).write_text("[1, 2")
    monkeypatch.setattr(prefill_choice, "measure", lambda: {"int8pack": 1.0, "fp32": 2.0})
    assert prefill_choice.prefill_path() == "int8pack"
    assert json.loads((fresh_choice / prefill_choice.FILE).read_text())  # rewritten, whole


@pytest.mark.parametrize("weights", ["int8", "w8a8"])
@pytest.mark.parametrize("runner_ops", ["torch", "cpu"])
@pytest.mark.parametrize("m", [1, 16, 63, 64, 300])
def test_many_rows_take_the_chosen_path_and_few_rows_the_int8_kernel(
    m, runner_ops, weights, monkeypatch, op_calls
):
    """fp32 chosen: from PREFILL_ROWS rows on, both runners' linears dequantize-then-fp32 (fp32
    rounding only, far inside the bf16 kernel's bound); fewer rows keep an int8 kernel (one
    byte a weight). The choice is the runner's (`kernel_table.py`): the INT8 layer called
    alone runs its own forward whatever was measured."""
    if runner_ops == "cpu" and not cpu_ext.available():
        pytest.skip("C++ kernels unavailable")
    monkeypatch.setenv(prefill_choice.ENV, "fp32")
    layer = make_layer(576, 96, bias=True)
    outer = Linear(576, 96, bias=True)
    outer.int8 = layer
    ops = TorchOps() if runner_ops == "torch" else CpuOps(cpu_ext.load())
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    xq = quantize_activations(x) if weights == "w8a8" else x
    with torch.no_grad():
        y = ops.linear(outer, x, W8.with_weights(weights))
    exact = fp64_reference(xq, layer)
    if m >= prefill_choice.PREFILL_ROWS:
        assert not op_calls
        assert (y.double() - exact).abs().max() <= 1e-5 * magnitude(xq, layer).max()
        op_calls.clear()
        layer(x)  # (its own forward: torch's int8 kernel)
        assert len(op_calls) == 1
    elif runner_ops == "torch" or m > MAX_STEP_ROWS:
        assert len(op_calls) == 1
    else:
        assert not op_calls  # (a step: the CPU runner's row kernels)


def test_the_row_kernels_are_a_candidate_only_where_they_run(monkeypatch):
    """Measured with the C++ kernels: three paths; without them (QSPEC_CPU_KERNELS=0) two,
    another machine key, and a forced "rows" runs torch's int8 kernel instead."""
    with_kernels = prefill_choice.machine_key()
    if cpu_ext.available():
        assert set(prefill_choice.measure((32, 128, 64), repeats=1)) == set(prefill_choice.PATHS)
    monkeypatch.setenv("QSPEC_CPU_KERNELS", "0")
    assert set(prefill_choice.measure((32, 128, 64), repeats=1)) == {"int8pack", "fp32"}
    assert prefill_choice.machine_key() != with_kernels or not cpu_ext.available()
    monkeypatch.setenv(prefill_choice.ENV, "rows")
    assert prefill_choice.prefill_path() == "int8pack"
