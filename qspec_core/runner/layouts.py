"""What a CPU runner derives from the model's weights for its kernels, made on first use.

Two kinds, both dropped by `clear` (the runner's `rebuild`, after the model's tensors are
replaced or changed):

- the 4-bit twins' layouts for PyTorch's CPU int4 kernel (`CpuLayouts`, `quant/int4.py`);
- **bf16 copies of fp32 weights that hold bf16 numbers** (`bf16`). A bf16 checkpoint loaded
  in fp32 (SmolLM2, Qwen2.5: the "full" weights of `--target-weights full` and of `ar`) holds
  weights whose upcast was exact. The few-row linears of a decode or verify step
  (`kernels/cpu/linear.h`) widen bf16 weights to fp32 in registers and then do exactly what
  they do on fp32 weights, the same products in the same order, so a step on the copy gives
  the same bits while reading half the bytes, and a decode step is a stream over the weights.
  Only where the extension says a bf16 weight gives its upcast's bits (`BF16_WEIGHT_ROWS`:
  the vector builds). The fp32 weights stay: the prefill's GEMM runs on them.

A copy is read while its weight is the tensor copied: the same storage at the same version.
After an in-place change (or `.data =`) the fp32 weight is read, here and in the decode stack
(`kernels/cpu/step.cpp`), until the runner's `rebuild` lets them be made again; a change
through `.data` that keeps the storage (`w.data.mul_()`) bumps no version and needs that
rebuild before the next step. Weights made under `torch.inference_mode` have no version
counter, so they get no copy. Copies are made on a layer's first step (Qwen2.5-0.5B: about a
second, once) and cost half the fp32 weights' memory.
"""

from __future__ import annotations

import weakref

import torch

from qspec_core.quant.int4 import CpuLayouts


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` as bf16 when that holds the same numbers (an fp32 CPU tensor whose values are
    all bf16 numbers), else None."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.numel() == 0:
        return None
    weight = weight.detach()
    first = weight.reshape(-1)[: weight.shape[-1]]  # (one row first: an fp32 checkpoint's
    if not torch.equal(first.to(torch.bfloat16).float(), first):  # weights fail at once)
        return None
    copy = weight.to(torch.bfloat16).contiguous()
    return copy if torch.equal(copy.float(), weight) else None


class WeightLayouts(CpuLayouts):
    """One runner's derived weights (see the module docstring). `bf16_rows`: whether its kernels
    take bf16 copies (the extension's `BF16_WEIGHT_ROWS`); False: `bf16` is always None."""

    def __init__(self, bf16_rows: bool):
        super().__init__()
        self.bf16_rows = bf16_rows
        # layer -> (its weight when copied, that weight's storage and version, the copy or
        # None); weak: a module made for one decode (a sliced head) takes its entry with it
        self._bf16: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def bf16(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """`layer.weight` as bf16 (`bf16_copy`) while that weight is unchanged since it was
        first asked for; None where it is not made of bf16 numbers, has changed, or this
        runner's kernels take no copies."""
        if not self.bf16_rows:
            return None
        weight = layer._parameters["weight"]  # (dict reads: nn.Module.__getattr__ is slow)
        if weight.is_inference():  # (no version counter: a change in place would go unseen)
            return None
        made = self._bf16.get(layer)
        if made is None:
            made = (weight, weight.data_ptr(), weight._version, bf16_copy(weight))
            self._bf16[layer] = made
        current = made[0] is weight and made[1] == weight.data_ptr() and made[2] == weight._version
        return made[3] if current else None

    def clear(self) -> None:
        super().clear()
        self._bf16.clear()
