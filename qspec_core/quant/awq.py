"""AWQ (Lin et al., 2023) for the 4-bit draft weights: our own implementation.

Activation-aware scaling: input channels that carry large activations matter more, so the
weight is quantized as Q(W * s) with s = mean|x|^alpha per input channel, and applied as
Q(W * s) (x / s). alpha is searched on a grid per layer to minimize the layer's output error
on calibration inputs. AutoAWQ folds 1/s into the preceding norm; qspec's draft shares its
norms (and KV) with the target, so 1/s stays an explicit per-channel input scale of the
draft layer (`Int4Linear.input_scale`). The clipping search of the paper is not done.
"""

from __future__ import annotations

import torch

from qspec_core.quant.hooks import InputHooks
from qspec_core.quant.int4 import dequantize, rtn_quantize


def awq_quantize(
    weight: torch.Tensor,
    act_absmean: torch.Tensor,
    act_sample: torch.Tensor,
    group_size: int,
    n_grid: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K]; act_absmean [K] = mean |x| per input channel; act_sample [n, K].

    Returns q uint8 [N, K], scale/zero fp32 [N, K/G] (of W * s) and input_scale [K] (= 1/s).
    alpha = 0 (s = 1) is plain RTN, so the result is never worse than RTN on the sample.
    """
    W = weight.float()
    x = act_sample.float()
    ref = x @ W.t()  # [n, N]
    best = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = act_absmean.float().clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # keep scales centred around 1
        q, scale, zero = rtn_quantize(W * s[None, :], group_size)
        approx = (x / s[None, :]) @ dequantize(q, scale, zero).t()
        err = float((approx - ref).pow(2).mean())
        if best is None or err < best[0]:
            best = (err, q, scale, zero, 1.0 / s)
    return best[1], best[2], best[3], best[4]


class ActivationCollector(InputHooks):
    """Forward hooks keeping mean |x| per input channel and a row sample of each layer input."""

    def __init__(self, layers: dict[str, torch.nn.Module], max_rows: int = 512):
        self.max_rows = max_rows
        self.absmean = {}
        self.sample = {}
        self._count = {}
        super().__init__(layers)

    def add(self, name: str, inputs: torch.Tensor) -> None:
        """Add the inputs [..., K] of layer `name` (what its hook sees) to its statistics."""
        x = inputs.reshape(-1, inputs.shape[-1]).float()  # [n, K]
        n = self._count.get(name, 0)
        total = x.abs().sum(0)
        prev = self.absmean.get(name)
        self.absmean[name] = (
            total / x.shape[0] if prev is None else ((prev * n + total) / (n + x.shape[0]))
        )
        self._count[name] = n + x.shape[0]
        kept = self.sample.get(name)
        room = self.max_rows - (0 if kept is None else kept.shape[0])
        if room > 0:
            rows = x[torch.linspace(0, x.shape[0] - 1, min(room, x.shape[0])).long()]
            self.sample[name] = rows if kept is None else torch.cat([kept, rows])
