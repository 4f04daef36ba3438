"""The four ops of a decoder layer that a runner may compute with its own kernels.

The model's layer loop (`transformer.py`) is written once, in plain PyTorch, and calls every
linear, norm, residual-plus-norm and rotation through an `ops` object passed down with the
forward: `model(tokens, input_pos, cache, path, ops=...)`. The default, `TORCH_OPS`, is each
module's own forward (a module call, so forward hooks run: calibration relies on it); the CPU
runner (`qspec_core/runner/cpu.py`) passes its own, which picks the batch-invariant few-row
kernels and the C++ norms and RoPE. The choice is an argument of the call, never state on the
model, so the model stays math only and one model serves any number of runners.
"""

from __future__ import annotations

import torch

from qspec_core.model.rope import apply_rotary
from qspec_core.precision import Precision


class LayerOps:
    """PyTorch's own ops (see the module docstring); subclass to swap kernels in. Stateless."""

    def linear(self, layer, x: torch.Tensor, path: Precision) -> torch.Tensor:
        """`layer` (a `transformer.Linear`) on x [..., K] with `path`'s weights -> [..., N]."""
        return layer(x, path)

    def linears(self, layers, x: torch.Tensor, path: Precision) -> list[torch.Tensor]:
        """[self.linear(layer, x, path) for layer in layers]: several layers of one input (a
        layer's q, k, v; gate, up), which a subclass may run in one call. Like `linear`, each
        output is a fresh tensor the caller owns (`act_mul` may overwrite it)."""
        return [self.linear(layer, x, path) for layer in layers]

    def act_mul(self, act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated MLP's act(gate) * up. A subclass may overwrite gate (the projection's
        fresh output)."""
        return act(gate) * up

    def norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        """`norm` (a `transformer.RMSNorm`) over x's last dimension."""
        return norm(x)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, norm) -> tuple[torch.Tensor, ...]:
        """The residual add and the next norm: (x + h, norm(x + h)). A subclass may update x
        in place (the layer loop owns the residual stream)."""
        x = x + h
        return x, self.norm(norm, x)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A projection's heads x [B, T, n, D], rotated by cos/sin [T, D] -> [B, n, T, D]. A
        subclass may rotate x in place (it is the projection's fresh output)."""
        return apply_rotary(x.transpose(1, 2), cos, sin)


TORCH_OPS = LayerOps()
