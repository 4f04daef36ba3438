"""The torch runner: the model's own forward, as is (the PyTorch reference).

What `build_runner` gives where no native runner applies: a GPU (there the model's quantized
twins and the cache's attention call the Triton kernels themselves), a CPU without qspec's C++
kernels (`QSPEC_CPU_KERNELS=0`, or a failed build), or a family whose layer the C++ stack does
not compute (`LayerSpec.native_ok()` false). It owns nothing, so its lifecycle is empty; it is
a runner so that the runtime and the engine treat every model alike.
"""

from __future__ import annotations

import torch

from qspec_core.precision import FP, Precision


class OfModel:
    """What every runner reports of the model it runs: its config, device and dtype."""

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


class TorchRunner(OfModel):
    """`model(...)` itself (see the module docstring)."""

    kind = "torch"

    def __init__(self, model):
        self.model = model

    def rebuild(self) -> None:
        """Nothing to rebuild: the model's forward reads its tensors on every call."""

    def close(self) -> None:
        """Nothing to release."""

    def __call__(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        cache,
        path: Precision = FP,
        last_only: bool = False,
    ) -> torch.Tensor:
        return self.model(tokens, input_pos, cache, path, last_only)
