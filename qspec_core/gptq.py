"""GPTQ (Frantar et al., 2022) for the 4-bit draft weights: our own implementation.

Columns are quantized one at a time in input order; each column's rounding error is spread
over the not-yet-quantized columns through the inverse Hessian of the layer's inputs
(H = 2 X^T X), so the layer's *output* error on the calibration data is what gets minimized.
Group scales/zeros are fitted on the error-updated weights when a group starts, as in the
reference algorithm; zero points are integers, so results export as standard GPTQ.
"""

from __future__ import annotations

import torch

from qspec_core.quant_linear import rtn_quantize


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    damp_percent: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] (sum of x x^T over calibration inputs) -> q, scale, zero.

    Returns q uint8 [N, K] and fp32 scale/zero [N, K/G], the same format as `rtn_quantize`.
    """
    W = weight.float().clone()
    N, K = W.shape
    if K % group_size:
        raise ValueError(f"in_features {K} is not a multiple of the group size {group_size}")
    H = hessian.float().clone()
    dead = torch.diag(H) == 0  # inputs never active: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp_percent * torch.diag(H).mean() * torch.eye(K)
    # Upper Cholesky factor of H^-1: row i holds the update coefficients for columns >= i.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    q = torch.zeros(N, K, dtype=torch.uint8)
    scale = torch.zeros(N, K // group_size)
    zero = torch.zeros(N, K // group_size)
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        W1 = W[:, b0:b1].clone()  # [N, B] updated lazily within the block
        err = torch.zeros_like(W1)
        H1 = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                current = torch.cat([W1[:, i:], W[:, b1:]], 1)[:, :group_size]
                _, s, z = rtn_quantize(current, group_size)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            s, z = scale[:, col // group_size], zero[:, col // group_size]
            w = W1[:, i]
            qc = torch.clamp(torch.round(w / s) + z, 0, 15)
            q[:, col] = qc.to(torch.uint8)
            e = (w - (qc - z) * s) / H1[i, i]
            W1[:, i:] -= e[:, None] * H1[i, i:][None, :]
            err[:, i] = e
        W[:, b1:] -= err @ Hinv[b0:b1, b1:]
    return q, scale, zero


class HessianCollector:
    """Forward hooks that sum x^T x over the inputs of each linear layer (calibration)."""

    def __init__(self, layers: dict[str, torch.nn.Module]):
        self.hessians = {name: None for name in layers}
        self.tokens = 0
        self._handles = [
            layer.register_forward_hook(self._hook(name)) for name, layer in layers.items()
        ]

    def _hook(self, name):
        def hook(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [n, K]
            h = 2 * x.t() @ x
            prev = self.hessians[name]
            self.hessians[name] = h if prev is None else prev + h

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
