"""Which kernel runs each stage on CPU: one table for the linears, keyed by (weight format,
backend, rows), and the prefill attention's products (`prefill_attention`). The runners read
it and nothing else chooses: quantized layers and caches hold data and their own (reference)
forward, and run what they are given.

Where each stage's kernel is chosen:

    linears, every row count      TABLE below: `CpuOps.linear` (`cpu.py`) and `TorchOps.linear`
                                  (`reference.py`) run the entry's `run`; `build_stack`
                                  (`cpu_stack.py`) asks the "step" entry which
                                  `DecoderStack.add_*_linear` takes the layer (`Kernel.stack`)
    prefill attention products    `prefill_attention` below, from the measured
                                  `products_choice.py`; the engine hands them to the caches
    decode / verify step          the CPU runner's C++ stack (`cpu.py`), else the layer loop
                                  with the table's linears; its attention is the cache's fused
                                  kernel for the tensor's device (`kernels/attention.backend`)

Weight formats (`weight_format`: what a `model.Linear` runs on one weight set):

    float   no twin: the layer's own weight (fp32, or the model's float dtype; a bf16 weight
            held under fp32 where `holds_bf16`, which every kernel upcasts exactly)
    int8    an INT8 twin, activations as they come (W8A32 on the row kernels)
    w8a8    an INT8 twin, activations rounded to int8 per 64 inputs (`Linear.int8_activations`)
    w4a8    a plain 4-bit twin (no AWQ scales, no act-order, whole 64-groups:
            `Int4Linear.w4a8_args`), activations rounded to int8 per 64 inputs
    int4    any other 4-bit twin: its own forward
    other   a twin of another kind: its own forward

Backends: "cpu" (the CPU runner: qspec's C++ kernels), "torch" (the torch runner on a CPU:
PyTorch's ops only). Any other device runs every format's own forward (`OWN`).

Rows: "step" (1..MAX_STEP_ROWS: a decode or verify step, where every kernel is
batch-invariant), "prefill" (more), and for the INT8 formats the product this machine measured
fastest for many rows (`prefill_choice.py`, asked only for formats with such an entry):
"prefill_rows" (qspec's row kernels, as a GEMM) or, from `PREFILL_ROWS` rows on,
"prefill_fp32" (the weight dequantized, fp32 GEMM); "int8pack" is the twin's own forward.

A kernel whose input checks fail (a dtype, a shape, a weight layout it does not take) returns
None and the format's own forward runs (`OWN`). A format not in `FORMATS` raises ValueError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import MAX_STEP_ROWS
from kernels.cpu import build as cpu_ext
from kernels.cpu import linear as rows_kernels
from kernels.formats import quantize_activations
from kernels.triton.w8a16 import w8a16_ref
from qspec_core.model.transformer import held_weight
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.runner.prefill_choice import PREFILL_ROWS, prefill_path
from qspec_core.runner.products_choice import exact_products, prefill_products

FORMATS = ("float", "int8", "w8a8", "w4a8", "int4", "other")
ROWS = ("step", "prefill", "prefill_rows", "prefill_fp32")
BACKENDS = ("cpu", "torch")

# run(layer, twin, x, layouts) -> y, or None: this input does not fit the kernel. `layouts`: the
# runner's `WeightLayouts` (`layouts.py`: the CPU int4 kernel's weight layouts, the bf16 copies of
# bf16-valued fp32 weights), or None.
Run = Callable[..., "torch.Tensor | None"]


@dataclass(frozen=True)
class Kernel:
    name: str
    run: Run
    stack: str | None = None  # the DecoderStack method that adds the layer to a step; None: none


def holds_bf16(device: torch.device | str) -> bool:
    """Whether the CPU runner holds a bf16 checkpoint's full weights as bf16 under fp32
    activations (`build_model`'s `bf16_held`): where its step kernels read bf16 weights for
    their fp32 upcast's bits (the extension's `BF16_WEIGHT_ROWS`: the vector builds), so a
    step reads 2 bytes a weight, and a prefill's GEMM upcasts one weight at a time (the same
    numbers as fp32 weights). Elsewhere (no C++ kernels, a portable build, another device)
    every step would upcast the whole model: fp32 weights."""
    if torch.device(device).type != "cpu" or not cpu_ext.available():
        return False
    return bool(getattr(cpu_ext.load(), "BF16_WEIGHT_ROWS", False))


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
    return torch.nn.functional.linear(x, held_weight(layer, x.dtype), layer._parameters["bias"])


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


def _int8_fp32(layer, twin, x, layouts):
    """W dequantized, then fp32's GEMM (`w8a16_ref`): fp32 rounding only."""
    buffers = twin._buffers
    return w8a16_ref(x, buffers["weight_int8"], buffers["weight_scale"], buffers["bias"])


def _w8a8_fp32(layer, twin, x, layouts):
    """`_int8_fp32` on activations rounded as the W8A8 kernels round them."""
    return _int8_fp32(layer, twin, quantize_activations(x).to(x.dtype), layouts)


TORCH = Kernel("torch_linear", _torch_linear)
TWIN = Kernel("twin", _twin)
TWIN_A8 = Kernel("twin_a8", _twin_a8)
# Each format's own forward: what runs off the table (another device, an input a kernel does
# not take)
OWN = {"float": TORCH, "int8": TWIN, "w8a8": TWIN_A8, "w4a8": TWIN, "int4": TWIN, "other": TWIN}

W8A8_GEMM = Kernel("w8a8_gemm", _w8a8_gemm)
INT8_FP32 = Kernel("int8_fp32", _int8_fp32)
W8A8_FP32 = Kernel("w8a8_fp32", _w8a8_fp32)
TABLE: dict[tuple[str, str, str], Kernel] = {
    ("float", "cpu", "step"): Kernel("linear_rows", _float_rows, stack="add_linear"),
    ("float", "cpu", "prefill"): TORCH,
    ("int8", "cpu", "step"): Kernel("int8_rows", _int8_rows, stack="add_int8_linear"),
    ("int8", "cpu", "prefill"): TWIN,
    ("int8", "cpu", "prefill_rows"): Kernel("int8_row_slices", _int8_row_slices),
    ("w8a8", "cpu", "step"): Kernel("w8a8_rows", _w8a8_rows, stack="add_int8_linear"),
    ("w8a8", "cpu", "prefill"): TWIN_A8,
    ("w8a8", "cpu", "prefill_rows"): W8A8_GEMM,
    ("int8", "cpu", "prefill_fp32"): INT8_FP32,
    ("w8a8", "cpu", "prefill_fp32"): W8A8_FP32,
    ("w4a8", "cpu", "step"): Kernel("w4a8_rows", _w4a8_rows, stack="add_int4_linear"),
    ("w4a8", "cpu", "prefill"): TWIN,
    ("int4", "cpu", "step"): TWIN,
    ("int4", "cpu", "prefill"): TWIN,
    ("other", "cpu", "step"): TWIN,
    ("other", "cpu", "prefill"): TWIN,
    # the torch runner: each format's own forward but where this machine measured the fp32
    # path fastest for an INT8 prefill
    ("int8", "torch", "prefill_fp32"): INT8_FP32,
    ("w8a8", "torch", "prefill_fp32"): W8A8_FP32,
}
# the measured INT8 prefill product (`prefill_choice.PATHS`) -> the rows key it runs under
MEASURED_ROWS = {"rows": "prefill_rows", "fp32": "prefill_fp32", "int8pack": "prefill"}


class PrefillPath:
    """A runner's `prefill_path()`: the machine's measured many-row INT8 product
    (`prefill_choice.py`), asked on the first one (it may measure: seconds, once per machine)
    and kept, so that one runner's prefills all compute alike."""

    def __init__(self):
        self._path: str | None = None

    def __call__(self) -> str:
        if self._path is None:
            self._path = prefill_path()
        return self._path


def row_class(n_rows: int, fmt: str, backend: str, prefill_path: Callable[[], str]) -> str:
    """The table's rows key for `n_rows` rows; `prefill_path()` (the measured INT8 prefill
    product) is asked only when the format has an entry for a measured product here."""
    if n_rows <= MAX_STEP_ROWS:
        return "step"
    measured = [k for k in ("prefill_rows", "prefill_fp32") if (fmt, backend, k) in TABLE]
    if not measured:
        return "prefill"
    chosen = MEASURED_ROWS[prefill_path()]
    if chosen == "prefill_fp32" and n_rows < PREFILL_ROWS:
        return "prefill"  # (dequantizing W for a few rows reads 9 bytes a weight, not one)
    return chosen if chosen in measured else "prefill"


def choose(fmt: str, backend: str, n_rows: int, prefill_path: Callable[[], str]) -> Kernel:
    """The kernel of a linear of format `fmt` on `backend` (BACKENDS; another device's name:
    every format's own forward) with `n_rows` rows (see the module docstring); ValueError for a
    format the table does not know."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if backend not in BACKENDS:
        return OWN[fmt]
    key = (fmt, backend, row_class(n_rows, fmt, backend, prefill_path))
    return TABLE.get(key, OWN[fmt])


def step_kernel(fmt: str) -> Kernel:
    """The kernel of a decode step's linear (what the one-call stack runs)."""
    return TABLE[(fmt, "cpu", "step")]


def backend_of(x: torch.Tensor, backend: str) -> str:
    """The table's backend for x: the runner's (`backend`) on a CPU, else x's device."""
    return backend if x.device.type == "cpu" else x.device.type


def run_linear(
    layer, x: torch.Tensor, weights: str, prefill_path, layouts=None, backend: str = "cpu"
) -> torch.Tensor:
    """`layer(x, weights)` through the table's kernel for the runner's `backend`, or the
    format's own forward where the kernel does not take x."""
    twin = layer.twin(weights)
    fmt = weight_format(layer, weights, twin)
    kernel = choose(fmt, backend_of(x, backend), rows(x), prefill_path)
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
            and choose("w8a8", backend_of(x, "cpu"), rows(x), prefill_path) is W8A8_GEMM
            and all(_gemm_takes(t, x) for t in twins)
        )
        if one_call:
            return rows_kernels.w8a8_prefill(x, [_int8_args(t) for t in twins])
    return [run_linear(layer, x, weights, prefill_path, layouts) for layer in layers]


# --------------------------------------------------------------------- the prefill attention
def prefill_attention(cache_kind: str, device: torch.device | str) -> str:
    """The products of a prefill chunk's causal attention (`kernels.cpu.attention.PRODUCTS`)
    in a cache of `cache_kind`: "hierarchical" (QuantSpec's chunked prefill: the products
    measured fastest, `products_choice.prefill_products`) or "full" (the full-precision cache:
    the fp32 numbers on the faster path, `products_choice.exact_products`). "fp32" off the CPU
    (the caches' attention ignores it there)."""
    if torch.device(device).type != "cpu":
        return "fp32"
    if cache_kind == "hierarchical":
        return prefill_products()
    if cache_kind == "full":
        return exact_products()
    raise ValueError(f"unknown cache kind {cache_kind!r}: expected hierarchical or full")
