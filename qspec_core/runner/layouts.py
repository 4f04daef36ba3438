"""What a CPU runner derives from the model's weights for its kernels, made on first use.

Two kinds, both dropped by `clear` (the runner's `rebuild`, after the model's tensors are
replaced):

- the 4-bit twins' layouts for PyTorch's CPU int4 kernel (`CpuLayouts`, `quant/int4.py`);
- **bf16 copies of fp32 weights that hold bf16 numbers** (`bf16`). A bf16 checkpoint loaded
  in fp32 (SmolLM2, Qwen2.5: the "full" weights of `--target-weights full` and of `ar`) holds
  weights whose upcast was exact. The few-row linears of a decode or verify step
  (`kernels/cpu/linear.h`) widen bf16 weights to fp32 in registers and then do exactly what
  they do on fp32 weights, the same products in the same order, so a step on the copy gives
  the same bits while reading half the bytes, and a decode step is a stream over the weights.
  Only where the extension says a bf16 weight gives its upcast's bits (`BF16_WEIGHT_ROWS`:
  the vector builds). The fp32 weights stay: the prefill's GEMM runs on them. A copy is
  checked against its weight's version counter at every use: after an in-place change to the
  weight, the copy is made again (or not, if the new numbers are not bf16 numbers). Weights
  made under `torch.inference_mode` have no version counter, so they get no copy.
"""

from __future__ import annotations

import torch

from qspec_core.quant.int4 import CpuLayouts


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` as bf16 when that holds the same numbers (an fp32 CPU tensor whose values are
    all bf16 numbers), else None."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    weight = weight.detach()
    copy = weight.to(torch.bfloat16).contiguous()
    return copy if torch.equal(copy.float(), weight) else None


class WeightLayouts(CpuLayouts):
    """One runner's derived weights (see the module docstring). `bf16_rows`: whether its kernels
    take bf16 copies (the extension's `BF16_WEIGHT_ROWS`); False: `bf16` is always None."""

    def __init__(self, bf16_rows: bool):
        super().__init__()
        self.bf16_rows = bf16_rows
        # layer -> (the weight copied, its version then, the copy or None)
        self._bf16: dict[torch.nn.Module, tuple[torch.Tensor, int, torch.Tensor | None]] = {}

    def bf16(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """`layer.weight` as bf16 (`bf16_copy`), made once per version of that weight; None
        where it is not made of bf16 numbers or this runner's kernels take no copies."""
        if not self.bf16_rows:
            return None
        weight = layer._parameters["weight"]  # (dict reads: nn.Module.__getattr__ is slow)
        if weight.is_inference():  # (no version counter: a change in place would go unseen)
            return None
        made = self._bf16.get(layer)
        if made is not None and made[0] is weight and made[1] == weight._version:
            return made[2]
        copy = bf16_copy(weight)
        self._bf16[layer] = (weight, weight._version, copy)
        return copy

    def clear(self) -> None:
        super().clear()
        self._bf16.clear()
