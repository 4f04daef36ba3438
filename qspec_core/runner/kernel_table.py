"""Which kernel runs a linear on CPU: one table, keyed by (weight format, device, rows).

Both consumers read it: `CpuOps.linear` (`cpu.py`), the model's PyTorch layer loop, runs the
entry's `run`; `build_stack` (`cpu_stack.py`), the one-call decode step, asks the "step" entry
which `DecoderStack.add_*_linear` takes the layer (`Kernel.stack`; None: the stack cannot run
it). So the choice exists once.

Weight formats (`weight_format`: what a `model.Linear` runs on one weight set):

    float   no twin: the layer's own weight (fp32, or the model's float dtype)
    int8    an INT8 twin, activations as they come (W8A32 on the row kernels)
    w8a8    an INT8 twin, activations rounded to int8 per 64 inputs (`Linear.int8_activations`)
    w4a8    a plain 4-bit twin (no AWQ scales, no act-order, whole 64-groups:
            `Int4Linear.w4a8_args`), activations rounded to int8 per 64 inputs
    int4    any other 4-bit twin: its own forward
    other   a twin of another kind: its own forward

Rows: "step" (1..MAX_STEP_ROWS: a decode or verify step, where every kernel is
batch-invariant), "prefill" (more), "prefill_rows" (more, on a machine whose measured INT8
prefill path is the row kernels: `quant/prefill_choice.py`, asked only for the formats that
have such an entry).

A kernel whose input checks fail (a dtype, a shape, a weight layout it does not take) returns
None and the format's own forward runs (`OWN`); so does every device but the CPU. A format
not in `FORMATS` raises ValueError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import MAX_STEP_ROWS
from kernels.cpu import linear as rows_kernels
from kernels.formats import quantize_activations
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear

FORMATS = ("float", "int8", "w8a8", "w4a8", "int4", "other")
ROWS = ("step", "prefill", "prefill_rows")

# run(layer, twin, x, layouts) -> y, or None: this input does not fit the kernel. `layouts`: the
# runner's `WeightLayouts` (`layouts.py`: the CPU int4 kernel's weight layouts, the bf16 copies of
# bf16-valued fp32 weights), or None.
Run = Callable[..., "torch.Tensor | None"]


@dataclass(frozen=True)
class Kernel:
    name: str
    run: Run
    stack: str | None = None  # the DecoderStack method that adds the layer to a step; None: none


def weight_format(layer, weights: str, twin=False) -> str:
    """The format `layer` (a `model.Linear`) runs on the weight set `weights` (`twin`: its
    `layer.twin(weights)`, when the caller has it)."""
    twin = layer.twin(weights) if twin is False else twin
    if twin is None:
        return "float"
    if isinstance(twin, Int8Linear):
        return "w8a8" if layer.int8_activations(weights) else "int8"
    if isinstance(twin, Int4Linear):
        return "w4a8" if twin.w4a8_args() else "int4"
    return "other"


def rows(x: torch.Tensor) -> int:
    return rows_kernels.rows(x)


# ------------------------------------------------------------------------------ the kernels
def _float_rows(layer, twin, x, layouts):
    params = layer._parameters  # (dict reads: nn.Module.__getattr__ is slow)
    weight, bias = params["weight"], params["bias"]
    if rows_kernels.usable(x, weight):
        # (a bf16 copy holding the same numbers: the same bits, half the bytes; layouts.py)
        compact = layouts.bf16(layer) if layouts is not None else None
        return rows_kernels.linear(x, weight if compact is None else compact, bias)
    return None


def _torch_linear(layer, twin, x, layouts):
    params = layer._parameters
    return torch.nn.functional.linear(x, params["weight"], params["bias"])


def _int8_args(twin):
    buffers = twin._buffers
    # (a model cast with .to(bf16) casts the scale too: the kernels take fp32)
    return buffers["weight_int8"], buffers["weight_scale"].float().contiguous(), buffers["bias"]


def _int8_rows(layer, twin, x, layouts):
    if rows_kernels.int8_usable(x, twin._buffers["weight_int8"]):
        return rows_kernels.int8_linear(x, *_int8_args(twin))
    return None


def _w8a8_rows(layer, twin, x, layouts):
    if rows_kernels.w8a8_usable(x, twin._buffers["weight_int8"]):
        return rows_kernels.w8a8_linear(x, *_int8_args(twin))
    return None


def _int8_row_slices(layer, twin, x, layouts):
    """A W8A16 prefill through the step kernels, `SLICE_ROWS` rows a call (a decode's bits)."""
    if rows_kernels.int8_usable(x[..., :1, :], twin._buffers["weight_int8"]):
        return rows_kernels.in_slices(rows_kernels.int8_linear, x, *_int8_args(twin))
    return None


def _gemm_takes(twin, x) -> bool:
    """Whether the W8A8 prefill GEMM takes x through the INT8 twin (`w8a8_usable` checks a
    step's size: one row of x stands for all)."""
    return rows_kernels.w8a8_usable(x[..., :1, :], twin._buffers["weight_int8"])


def _w8a8_gemm(layer, twin, x, layouts):
    """A W8A8 prefill in one call, as a GEMM (`int_gemm.h`: one lane per chunk's integer dot
    with AVX-512 VNNI, else a decode step's blocks and bits)."""
    if _gemm_takes(twin, x):
        return rows_kernels.w8a8_linear(x, *_int8_args(twin))
    return None


def _w4a8_rows(layer, twin, x, layouts):
    if rows_kernels.int4_usable(x, twin.in_features, twin.group_size):
        return rows_kernels.int4_linear(x, *twin.w4a8_args(), bias=twin._buffers["bias"])
    return None


def _twin(layer, twin, x, layouts):
    if isinstance(twin, Int4Linear) and layouts is not None:
        return twin.forward(x, layouts.get(twin))
    return twin.forward(x)


def _twin_a8(layer, twin, x, layouts):
    """The INT8 twin's own kernel on activations rounded as the W8A8 kernels round them."""
    return twin.forward(quantize_activations(x).to(x.dtype))


TORCH = Kernel("torch_linear", _torch_linear)
TWIN = Kernel("twin", _twin)
TWIN_A8 = Kernel("twin_a8", _twin_a8)
# Each format's own forward: what runs off the table (another device, an input a kernel does
# not take)
OWN = {"float": TORCH, "int8": TWIN, "w8a8": TWIN_A8, "w4a8": TWIN, "int4": TWIN, "other": TWIN}

W8A8_GEMM = Kernel("w8a8_gemm", _w8a8_gemm)
TABLE: dict[tuple[str, str, str], Kernel] = {
    ("float", "cpu", "step"): Kernel("linear_rows", _float_rows, stack="add_linear"),
    ("float", "cpu", "prefill"): TORCH,
    ("int8", "cpu", "step"): Kernel("int8_rows", _int8_rows, stack="add_int8_linear"),
    ("int8", "cpu", "prefill"): TWIN,
    ("int8", "cpu", "prefill_rows"): Kernel("int8_row_slices", _int8_row_slices),
    ("w8a8", "cpu", "step"): Kernel("w8a8_rows", _w8a8_rows, stack="add_int8_linear"),
    ("w8a8", "cpu", "prefill"): TWIN_A8,
    ("w8a8", "cpu", "prefill_rows"): W8A8_GEMM,
    ("w4a8", "cpu", "step"): Kernel("w4a8_rows", _w4a8_rows, stack="add_int4_linear"),
    ("w4a8", "cpu", "prefill"): TWIN,
    ("int4", "cpu", "step"): TWIN,
    ("int4", "cpu", "prefill"): TWIN,
    ("other", "cpu", "step"): TWIN,
    ("other", "cpu", "prefill"): TWIN,
}


def row_class(n_rows: int, fmt: str, device: str, prefill_path: Callable[[], str]) -> str:
    """The table's rows key for `n_rows` rows; `prefill_path()` (the measured INT8 prefill
    product) is asked only when the format has a "prefill_rows" entry."""
    if n_rows <= MAX_STEP_ROWS:
        return "step"
    if (fmt, device, "prefill_rows") in TABLE and prefill_path() == "rows":
        return "prefill_rows"
    return "prefill"


def choose(fmt: str, device: str, n_rows: int, prefill_path: Callable[[], str]) -> Kernel:
    """The kernel of a linear of format `fmt` on `device` with `n_rows` rows (see the module
    docstring); ValueError for a format the table does not know."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: expected one of {', '.join(FORMATS)}")
    key = (fmt, device, row_class(n_rows, fmt, device, prefill_path))
    return TABLE.get(key, OWN[fmt])


def step_kernel(fmt: str) -> Kernel:
    """The kernel of a decode step's linear (what the one-call stack runs)."""
    return TABLE[(fmt, "cpu", "step")]


def run_linear(layer, x: torch.Tensor, weights: str, prefill_path, layouts=None) -> torch.Tensor:
    """`layer(x, weights)` through the table's kernel, or the format's own forward where the
    kernel does not take x."""
    twin = layer.twin(weights)
    fmt = weight_format(layer, weights, twin)
    kernel = choose(fmt, x.device.type, rows(x), prefill_path)
    y = kernel.run(layer, twin, x, layouts)
    return OWN[fmt].run(layer, twin, x, layouts) if y is None else y


def run_linears(layers, x: torch.Tensor, weights: str, prefill_path, layouts=None) -> list:
    """[run_linear(layer, x, ...) for layer in layers] (a layer's q, k, v; gate, up), the same
    numbers: where every layer runs the W8A8 prefill GEMM, in one call that rounds x once and
    runs the products in one parallel region (`linear.w8a8_prefill`)."""
    if rows(x) > MAX_STEP_ROWS and len(layers) > 1:  # (a step's layers: one at a time)
        twins = [layer.twin(weights) for layer in layers]
        formats = {weight_format(la, weights, t) for la, t in zip(layers, twins, strict=True)}
        one_call = (  # (the formats first: `prefill_path` may measure, once per machine)
            formats == {"w8a8"}
            and choose("w8a8", x.device.type, rows(x), prefill_path) is W8A8_GEMM
            and all(_gemm_takes(t, x) for t in twins)
        )
        if one_call:
            return rows_kernels.w8a8_prefill(x, [_int8_args(t) for t in twins])
    return [run_linear(layer, x, weights, prefill_path, layouts) for layer in layers]
