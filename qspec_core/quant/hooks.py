"""Calibration hooks: each linear's input, as its forward sees it, handed to a collector."""

from __future__ import annotations

import torch


class InputHooks:
    """Forward hooks on `layers` (linears by name) that call `add(name, x)` with each call's
    input x [..., K]; `close()` removes them. A subclass keeps what its quantizer needs, and
    `add` may be called directly for a layer that is not run as a module (lm_head's input,
    `convert/stream.py`)."""

    def __init__(self, layers: dict[str, torch.nn.Module]):
        self._handles = [
            layer.register_forward_hook(self._hook(name)) for name, layer in layers.items()
        ]

    def _hook(self, name):
        def hook(module, args, output):
            self.add(name, args[0])

        return hook

    def add(self, name: str, inputs: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
