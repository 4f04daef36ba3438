"""The CPU runner: a model's forward on qspec's C++ kernels (`kernels/cpu/`).

Built by `build_runner` (`__init__.py`) for a model of any family on a CPU where the kernels
are built. Two loops run the layers, and the runner picks one per forward:

- a decode or verify step (at most `MAX_STEP_ROWS` = gamma + 1 rows) in fp32 runs every
  decoder layer in one C++ call (`DecoderStack`, built per weight set by `cpu_stack.py`, owned
  by this runner) when the cache has a C++ side (`cache.native`, `cache.native_step`:
  `cache/protocol.py`) and the stack computes the model's layer (`ModelConfig.native_ok()`:
  every family's layer; Gemma 2's capped scores where the cache's step caps them): the stack
  takes the cache's object and the step it fills, and writes and attends through them; the
  model's `embed` and `head` run around it;
- anything else (a prefill chunk, bf16, a cache, a twin or a layer the stack does not take)
  runs the model's own PyTorch layer loop, called with this runner's `CpuOps`: RMSNorm (every
  kind), the residual add and RoPE (partial rotary included) in C++ when fp32
  (`kernels/cpu/decode.cpp`), the rest in PyTorch, and every linear through `CpuOps.linear`,
  which runs the kernel `kernel_table.py` chooses (the stack's builder reads the same table, so
  the choice exists once).

The table runs every linear of a step (at most `MAX_STEP_ROWS` rows) on a batch-invariant
few-row kernel (`kernels/cpu/linear.cpp`, and `int_dot.cpp` for the int8-activation sets
"w8a8" and the draft's "int4"): a row's result does not depend on how many rows share the call,
so a token's logits inside a verify are bit for bit those of the same token decoded alone, in
every dtype and weight set (greedy QuantSpec == target-ar rests on it). Longer inputs (prefill)
run PyTorch's GEMM or the quantized twin's own forward, or, for the INT8 sets, the row kernels a
slice at a time where this machine measured them fastest (`runner/prefill_choice.py`).

`tests/test_cpu_step.py` holds the C++ stack to the model's loop with these ops, bit for bit,
and `tests/test_cpu_decode.py` both to the plain PyTorch model.

A forward with autograd on runs the plain model (the engine always runs under inference mode).
Calibration (GPTQ, AWQ) never comes here: it runs the model itself, with the runner off, so
that its forward hooks run on every linear (`convert/convert.py`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kernels import MAX_STEP_ROWS
from qspec_core.model.ops import LayerOps
from qspec_core.precision import Precision
from qspec_core.runner.cpu_stack import build_stack, norm_weight
from qspec_core.runner.kernel_table import PrefillPath, run_linear, run_linears
from qspec_core.runner.layouts import WeightLayouts
from qspec_core.runner.reference import OfModel


class CpuOps(LayerOps):
    """A layer's ops on the C++ kernels `ext` (see the module docstring)."""

    def __init__(self, ext):
        self.ext = ext  # the loaded C++ extension (`kernels.cpu.build.load()`)
        self.prefill_path = PrefillPath()  # the INT8 prefill's product, asked once
        # seconds inside the linears this layer loop ran (a prefill's, and steps' where the
        # C++ stack does not run them), read as a difference by the prefill's stage timer
        # (`generate.linear_clock`): a perf_counter pair a call
        self.linear_seconds = 0.0
        # the 4-bit twins' layouts for PyTorch's CPU int4 kernel, the bf16 copies of fp32
        # weights that hold bf16 numbers (layouts.py)
        self.layouts = WeightLayouts(bool(getattr(ext, "BF16_WEIGHT_ROWS", False)))

    def norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        # (every kind: in fp32 they are one computation, Gemma's with 1 + w: `norm_weight`)
        if x.dtype == norm.weight.dtype == torch.float32 and x.is_contiguous():
            return self.ext.rms_norm_cpu(x, norm_weight(norm), norm.eps)
        return norm(x)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, norm) -> tuple[torch.Tensor, ...]:
        if x.dtype == h.dtype == norm.weight.dtype == torch.float32 and x.is_contiguous():
            # x += h in place
            return x, self.ext.add_rms_norm_cpu(x, h, norm_weight(norm), norm.eps)
        return super().add_norm(x, h, norm)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # (cos [T, r]: each head's first r channels, a partial rotary's too)
        if x.dtype == cos.dtype == torch.float32 and cos.shape[-1] <= x.shape[-1]:
            self.ext.rope_cpu(x, cos, sin)  # in place, on the projection's fresh output
            return x.transpose(1, 2)
        return super().rope(x, cos, sin)

    def linear(self, layer, x: torch.Tensor, path: Precision) -> torch.Tensor:
        """`layer(x, path)` (a `model.Linear`) on the kernel `kernel_table.py` chooses: the
        batch-invariant row kernels for at most MAX_STEP_ROWS rows, else PyTorch's GEMM, the
        twin's own forward, or the INT8 row kernels where this machine measured them fastest."""
        start = time.perf_counter()
        y = run_linear(layer, x, path.weights, self.prefill_path, self.layouts, "cpu")
        self.linear_seconds += time.perf_counter() - start
        return y

    def linears(self, layers, x: torch.Tensor, path: Precision) -> list[torch.Tensor]:
        """The layers of one input on the table's kernels; a W8A8 prefill's in one call
        (`kernel_table.run_linears`: x rounded once)."""
        start = time.perf_counter()
        ys = run_linears(layers, x, path.weights, self.prefill_path, self.layouts)
        self.linear_seconds += time.perf_counter() - start
        return ys

    def act_mul(self, act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if act is F.silu and gate.dtype == torch.float32 and gate.data_ptr() != up.data_ptr():
            # in place on the fresh projection: no [rows, I] allocations (the same kernels,
            # so the same bits as the C++ step's silu then multiply)
            return F.silu(gate, inplace=True).mul_(up)
        return super().act_mul(act, gate, up)


class CpuRunner(OfModel):
    """Runs `model`'s forward on CPU (see the module docstring); owns the C++ stacks built from
    the model's tensors, one per weight set, made on first use and dropped by `rebuild`."""

    kind = "cpu"

    def __init__(self, model, ext):
        self.model = model
        self.ext = ext
        self.ops = CpuOps(ext)
        self._stacks: dict[str, object | None] = {}  # weights -> DecoderStack, or None

    def rebuild(self) -> None:
        """Forget the stacks and the derived layouts (int4, bf16 copies): the next step builds
        them again from the model's tensors (call it after replacing a tensor or a twin in
        place of another)."""
        self._stacks.clear()
        self.ops.layouts.clear()

    def close(self) -> None:
        self.rebuild()

    @property
    def linear_seconds(self) -> float:
        """Seconds this runner's layer loop spent in linears so far (the C++ step's are not
        counted): the prefill's "linears" stage is its difference (`generate.linear_clock`)."""
        return self.ops.linear_seconds

    def stack(self, weights: str):
        """The DecoderStack of one weight set, built on first use; None where the model's
        weights need what the C++ loop does not run (`cpu_stack.py`)."""
        if weights not in self._stacks:
            self._stacks[weights] = build_stack(self.model, weights, self.ext, self.ops.layouts)
        return self._stacks[weights]

    def forward(self, tokens, input_pos, cache, path, last_only, head=None) -> torch.Tensor:
        """`model(tokens, input_pos, cache, path, last_only, head=head)`, run on the C++
        kernels."""
        model = self.model
        if torch.is_grad_enabled() or tokens.device.type != "cpu":
            return model(tokens, input_pos, cache, path, last_only, head=head)  # (plain model)
        step = stack = native = None
        B, T = tokens.shape
        if B * T <= MAX_STEP_ROWS and model.dtype == torch.float32:
            model.check_path(path)
            stack = self.stack(path.weights)
            native = getattr(cache, "native", None) if stack is not None else None
            if native is not None:
                step = cache.native_step(input_pos, path, T)  # the bookkeeping, all layers
        if step is None:
            return model(tokens, input_pos, cache, path, last_only, ops=self.ops, head=head)
        x = model.embed(tokens)  # [B, T, hidden]
        cos, sin = model.rotary_emb(input_pos, x.dtype, cache.rope_capacity)  # [T, r] each
        local = (None, None)  # (Gemma 3's sliding layers rotate with their own)
        if model.config.layer.local_rope:
            local = model.local_rotary_emb(input_pos, x.dtype)
        native = cache.native  # (the bookkeeping may have replaced a buffer: a local stack's)
        x = stack.run(x, cos, sin, native, step, *local)  # writes each layer's K/V through it
        return model.head(x, path, last_only, self.ops, head)
