"""The CPU runner's one kernel table (`qspec_core/runner/kernel_table.py`): which kernel each
(weight format, device, rows) gets, and what the decode stack adds."""

import pytest
import torch

from kernels import MAX_STEP_ROWS
from kernels.cpu import build as cpu_ext
from qspec_core.model.transformer import Linear
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.runner import kernel_table as table

K, N = 128, 32


def _layer(draft: str | None = None, int8: bool = True, k: int = K) -> Linear:
    """A model.Linear [N, k] with the twins asked for: draft "plain" (W4A8-ready), "awq"
    (AWQ scales: its own forward) or "other" (a twin of no known kind)."""
    layer = Linear(k, N, bias=False)
    if int8:
        layer.int8 = Int8Linear.from_linear(layer)
    if draft == "plain":
        layer.draft = Int4Linear.from_linear(layer, 64)
    elif draft == "awq":
        layer.draft = Int4Linear.from_linear(layer, 64).with_scales()
    elif draft == "other":
        layer.draft = torch.nn.Identity()
    return layer


@pytest.mark.parametrize(
    "draft, int8, k, weights, fmt",
    [
        (None, False, K, "full", "float"),
        (None, False, K, "int4", "float"),  # (no twin at all: its own weight)
        (None, True, K, "int8", "int8"),
        (None, True, K, "w8a8", "w8a8"),
        (None, True, K, "int4", "w8a8"),  # a draft on the INT8 twin rounds its activations
        (None, True, 96, "int4", "int8"),  # ... only in whole 64-chunks
        ("plain", True, K, "int4", "w4a8"),
        ("awq", True, K, "int4", "int4"),
        ("other", True, K, "int4", "other"),
        ("plain", True, K, "full", "float"),
    ],
)
def test_weight_format(draft, int8, k, weights, fmt):
    assert table.weight_format(_layer(draft, int8, k), weights) == fmt


def _never() -> str:
    raise AssertionError("the prefill path was asked where no entry depends on it")


# (format, rows, measured prefill path) -> kernel name on the CPU runner ("cpu"); None: the
# prefill path is not asked
EXPECTED = [
    ("float", 1, None, "linear_rows"),
    ("float", 17, None, "linear_rows"),
    ("float", 18, None, "torch_linear"),
    ("int8", 1, None, "int8_rows"),
    ("int8", 17, None, "int8_rows"),
    ("int8", 18, "rows", "int8_row_slices"),
    ("int8", 512, "int8pack", "twin"),
    ("int8", 512, "fp32", "int8_fp32"),
    ("int8", 63, "fp32", "twin"),  # (fp32 from PREFILL_ROWS on: W read at 9 bytes a weight)
    ("w8a8", 5, None, "w8a8_rows"),
    ("w8a8", 512, "rows", "w8a8_gemm"),
    ("w8a8", 512, "int8pack", "twin_a8"),
    ("w8a8", 512, "fp32", "w8a8_fp32"),
    ("w4a8", 1, None, "w4a8_rows"),
    ("w4a8", 512, None, "twin"),
    ("int4", 1, None, "twin"),
    ("int4", 512, None, "twin"),
    ("other", 1, None, "twin"),
    ("other", 512, None, "twin"),
]


# the torch runner on a CPU ("torch"): each format's own forward, but the measured fp32 path
EXPECTED_TORCH = [
    ("float", 1, None, "torch_linear"),
    ("float", 512, None, "torch_linear"),
    ("int8", 1, None, "twin"),
    ("int8", 512, "rows", "twin"),  # (no row kernels there: int8pack, prefill_choice)
    ("int8", 512, "int8pack", "twin"),
    ("int8", 512, "fp32", "int8_fp32"),
    ("w8a8", 5, None, "twin_a8"),
    ("w8a8", 512, "fp32", "w8a8_fp32"),
    ("w8a8", 512, "int8pack", "twin_a8"),
    ("w4a8", 1, None, "twin"),
    ("int4", 512, None, "twin"),
]


@pytest.mark.parametrize(
    "backend, fmt, n_rows, measured, name",
    [("cpu", *row) for row in EXPECTED] + [("torch", *row) for row in EXPECTED_TORCH],
)
def test_the_table_picks(backend, fmt, n_rows, measured, name):
    asked = _never if measured is None else (lambda: measured)
    assert table.choose(fmt, backend, n_rows, asked).name == name


def test_every_format_has_a_step_and_a_prefill_entry():
    for fmt in table.FORMATS:
        for rows in ("step", "prefill"):
            assert (fmt, "cpu", rows) in table.TABLE


@pytest.mark.parametrize("fmt", table.FORMATS)
def test_other_devices_run_the_formats_own_forward(fmt):
    assert table.choose(fmt, "cuda", 1, _never) is table.OWN[fmt]


def test_an_unknown_format_raises():
    with pytest.raises(ValueError, match="unknown weight format"):
        table.choose("fp8", "cpu", 1, _never)


def test_the_stack_adds_what_a_step_runs():
    stacks = {fmt: table.step_kernel(fmt).stack for fmt in table.FORMATS}
    assert stacks == {
        "float": "add_linear",
        "int8": "add_int8_linear",
        "w8a8": "add_int8_linear",
        "w4a8": "add_int4_linear",
        "int4": None,
        "other": None,
    }


@pytest.mark.skipif(not cpu_ext.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("draft, weights", [(None, "int8"), (None, "w8a8"), ("plain", "int4")])
def test_an_input_the_kernel_does_not_take_runs_the_own_forward(draft, weights):
    """fp64 activations: no row kernel takes them, so the format's own forward runs."""
    layer = _layer(draft).double()
    x = torch.randn(1, 3, K, dtype=torch.float64)
    got = table.run_linear(layer, x, weights, _never)
    fmt = table.weight_format(layer, weights)
    want = table.OWN[fmt].run(layer, layer.twin(weights), x, None)
    assert torch.equal(got, want)


@pytest.mark.skipif(not cpu_ext.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("rows, measured", [(40, "rows"), (40, "int8pack"), (5, "rows")])
def test_layers_of_one_input_compute_as_one_at_a_time(rows, measured, monkeypatch):
    """`run_linears` (a layer's q, k, v; gate, up): the numbers of `run_linear` per layer, bit
    for bit, whether the W8A8 prefill's products run in one call (more than MAX_STEP_ROWS rows, the
    GEMM path measured) or one by one."""
    torch.manual_seed(0)
    layers = [_layer(), _layer(), _layer(draft="plain")]
    layers[1].bias = torch.nn.Parameter(torch.randn(N))
    layers[1].int8 = Int8Linear.from_linear(layers[1])
    x = torch.randn(1, rows, K)
    one_call = []
    real = table.rows_kernels.w8a8_prefill
    monkeypatch.setattr(
        table.rows_kernels, "w8a8_prefill", lambda *a: one_call.append(1) or real(*a)
    )
    for weights, group in (("w8a8", layers), ("w8a8", layers[:2]), ("int4", layers[2:])):
        got = table.run_linears(group, x, weights, lambda: measured)
        want = [table.run_linear(layer, x, weights, lambda: measured) for layer in group]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    fused = rows > MAX_STEP_ROWS and measured == "rows"
    assert one_call == ([1, 1] if fused else [])  # (never for the 4-bit twins: W4A8)


@pytest.mark.skipif(not cpu_ext.available(), reason="C++ kernels not built")
def test_a_bf16_valued_weight_runs_from_its_bf16_copy_with_the_same_bits():
    """`WeightLayouts.bf16` (`runner/layouts.py`): a copy only of an fp32 weight whose numbers
    are all bf16 numbers, not read after a change (until `clear`, the runner's rebuild); the step
    kernel on the copy gives the fp32 weight's bits (1..17 rows, with a bias and a K % 8 tail);
    a prefill never reads it."""
    from qspec_core.runner.layouts import WeightLayouts, bf16_copy

    g = torch.Generator().manual_seed(3)
    layer = Linear(100, 37, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(37, 100, generator=g).bfloat16().float())
    layouts = WeightLayouts(bf16_rows=bool(cpu_ext.load().BF16_WEIGHT_ROWS))
    copy = layouts.bf16(layer)
    assert (copy is not None) == layouts.bf16_rows
    assert layouts.bf16(layer) is copy  # (made once)
    for rows in (1, 5, 17, 18):
        x = torch.randn(rows, 100, generator=g)
        got = table.run_linear(layer, x, "full", _never, layouts)
        assert torch.equal(got, table.run_linear(layer, x, "full", _never, None)), rows
    assert WeightLayouts(bf16_rows=False).bf16(layer) is None
    with torch.no_grad():
        layer.weight[3, 7] += 2.0**-20  # (no longer a bf16 number)
    assert layouts.bf16(layer) is None and bf16_copy(layer.weight) is None
    assert bf16_copy(layer.weight.double()) is None
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    assert layouts.bf16(layer) is None  # (changed: the fp32 weight until the runner's rebuild,
    layouts.clear()  # as the decode stack does)
    assert (layouts.bf16(layer) is not None) == layouts.bf16_rows
    x = torch.randn(3, 100, generator=g)
    got = table.run_linear(layer, x, "full", _never, layouts)
    assert torch.equal(got, table.run_linear(layer, x, "full", _never, None))
    layer.weight.data = layer.weight.data.clone()  # (new storage, no version bump)
    assert layouts.bf16(layer) is None
