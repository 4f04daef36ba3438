"""The torch runner: the model's own forward on PyTorch's ops (the PyTorch reference).

What `build_runner` gives where no native runner applies: a GPU (there the model's quantized
twins and the cache's attention call the Triton kernels themselves), a CPU without qspec's C++
kernels (`QSPEC_CPU_KERNELS=0`, or a failed build). Its linears take the kernel table's "torch"
backend (`kernel_table.py`): each format's own forward, but an INT8 prefill on the fp32 path
where this machine measured that fastest. It owns the layouts PyTorch's CPU int4 kernel takes
of the 4-bit twins (`TorchOps`), made on first use and dropped by `rebuild`; it is a runner so
that the runtime and the engine treat every model alike.
"""

from __future__ import annotations

import torch

from qspec_core.model.ops import LayerOps
from qspec_core.precision import FP, Precision
from qspec_core.quant.int4 import CpuLayouts
from qspec_core.runner.kernel_table import PrefillPath, run_linear


class OfModel:
    """What every runner shares: the model it runs (its config, device and dtype) and the
    call, `runner(tokens, input_pos, cache, path, last_only)`, which each runner's `forward`
    answers with its kernels."""

    model: torch.nn.Module

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def __call__(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        cache,
        path: Precision = FP,
        last_only: bool = False,
        head=None,
    ) -> torch.Tensor:
        """tokens [B, T] at input_pos [T] -> logits [B, T, V] ([B, 1, V]: last_only), as the
        model's own call computes them (`head`: the model's forward's)."""
        return self.forward(tokens, input_pos, cache, path, last_only, head)

    def forward(self, tokens, input_pos, cache, path, last_only, head=None) -> torch.Tensor:
        raise NotImplementedError


class TorchOps(LayerOps):
    """PyTorch's own ops, every linear on the kernel table's "torch" backend (`kernel_table.py`:
    each format's own forward, with the 4-bit twins' CPU int4 layouts kept, `CpuLayouts`; the
    fp32 path for an INT8 prefill where this machine measured it fastest)."""

    def __init__(self):
        self.layouts = CpuLayouts()
        self.prefill_path = PrefillPath()  # the INT8 prefill's product, asked once

    def linear(self, layer, x: torch.Tensor, path: Precision) -> torch.Tensor:
        return run_linear(layer, x, path.weights, self.prefill_path, self.layouts, "torch")


class TorchRunner(OfModel):
    """`model(...)` on PyTorch's ops (`TorchOps`; see the module docstring)."""

    kind = "torch"

    def __init__(self, model):
        self.model = model
        self.ops = TorchOps()

    def rebuild(self) -> None:
        """Drop the int4 layouts: the model's forward reads its other tensors on every call."""
        self.ops.layouts.clear()

    def close(self) -> None:
        self.ops.layouts.clear()

    def forward(self, tokens, input_pos, cache, path, last_only, head=None) -> torch.Tensor:
        return self.model(tokens, input_pos, cache, path, last_only, ops=self.ops, head=head)
