"""Runners: what runs a model's forward on one kind of device, above the model.

The model (`qspec_core/model/transformer.py`) is math only: a plain `nn.Module` that runs as is
on any device and imports no runner. A runner holds one model and runs its forward,
`runner(tokens, input_pos, cache, path, last_only)` (the model's own call), with its kernels:

- `CpuRunner` (`cpu.py`): a decode or verify step in one C++ call (the native stack, which it
  builds from the model's tensors and owns), anything else through the model's PyTorch layer
  loop with the runner's `CpuOps` (batch-invariant few-row linears, C++ norms and RoPE);
- `TorchRunner` (`reference.py`): the model's forward as is: GPUs (the quantized twins and the
  cache call the Triton kernels themselves) and CPUs without qspec's C++ kernels.

So two layer loops exist: the model's PyTorch loop, and the native stack.

Lifecycle, all of it explicit: the runtime builds the runner at load (`build_runner`, from
`registry/runtime.py`), after the model's twins are attached; a runner builds its native
stacks on first use from the tensors the model holds then; whoever replaces those tensors
(`Runtime.to` moving or casting the model) builds a new runner or calls `rebuild()`. Nothing is
kept beside a model or in a module: two runners of one model share nothing, and a model that
is dropped takes nothing with it. Calibration runs the model itself, the runner off.

Everything the engine runs takes a `Runner`; the model itself is one too (its own reference,
with no runner), which is what tests and calibration pass.
"""

from __future__ import annotations

from kernels.cpu import build
from qspec_core.model.transformer import Transformer
from qspec_core.runner.cpu import CpuRunner
from qspec_core.runner.reference import OfModel, TorchRunner

__all__ = ["CpuRunner", "Runner", "TorchRunner", "build_runner"]


# What runs forwards: a `CpuRunner`, a `TorchRunner` (both `OfModel`: the call, config,
# device and dtype), or a `Transformer` itself.
Runner = OfModel | Transformer


def build_runner(model) -> CpuRunner | TorchRunner:
    """The runner for `model` where it is now: the CPU runner on a CPU where qspec's C++ kernels
    are built (`QSPEC_CPU_KERNELS=0` turns them off), whatever the family (its one-call stack
    where it computes the layer, `ModelConfig.native_ok`), else the torch runner. Build it
    after the model's twins are attached and again after a move."""
    if model.device.type == "cpu" and build.available():
        return CpuRunner(model, build.load())
    return TorchRunner(model)
