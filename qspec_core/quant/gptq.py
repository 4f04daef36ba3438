"""GPTQ (Frantar et al., 2022) for the 4-bit draft and the INT8 verifier: our own implementation.

Columns are quantized one at a time in input order; each column's rounding error is spread
over the not-yet-quantized columns through the inverse Hessian of the layer's inputs
(H = 2 X^T X), so the layer's *output* error on the calibration data is what gets minimized.

- 4-bit draft (`gptq_quantize`): group scales/zeros are fitted on the error-updated weights
  when a group starts, as in the reference algorithm; zero points are integers, so results
  export as standard GPTQ.
- INT8 verifier (`gptq_quantize_int8`): the grid is fixed up front, per output channel and
  symmetric (scale max|w|/127, the grid `torch._weight_int8pack_mm` takes); GPTQ only chooses
  the rounding. On the default model it cuts the INT8 target's perplexity cost over 2,048
  tokens from +1.03% (round to nearest) to +0.35% (docs/PERF.md).

The column loop is thousands of tiny ops per layer, so it runs on one thread: with several,
every op ends in a thread barrier, and on a shared machine (another process busy on the same
cores) each barrier waits out a scheduler slice. Measured on 2 cores with another 2-thread
process busy: a 576x1536 layer took 27 s instead of 0.46 s. Quiet, one thread costs little:
0.39 s for that layer, 3.3 s instead of 2.2 s for a 18,992-row slice of a 0.5B model's lm_head.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch

from qspec_core.quant.hooks import InputHooks
from qspec_core.quant.int4 import n_groups, rtn_quantize


@contextmanager
def single_threaded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


INVERSE_BLOCK = 512  # columns per step of the triangular inverse (a GEMM per step)


def _lower_inverse_(L: torch.Tensor) -> torch.Tensor:
    """L^-1 of a lower-triangular L [K, K], in L's storage (LAPACK trtri's blocked order:
    from the last block up, each block's rows below it by the inverse already made there).
    2K^3/3 flops, almost all in GEMMs; no [K, K] identity beside it (0.8 GB at K = 14,336)."""
    K = L.shape[0]
    for j in range((K - 1) // INVERSE_BLOCK * INVERSE_BLOCK, -1, -INVERSE_BLOCK):
        e = min(j + INVERSE_BLOCK, K)
        eye = torch.eye(e - j, dtype=L.dtype)
        diag_inv = torch.linalg.solve_triangular(L[j:e, j:e], eye, upper=False)
        if e < K:  # rows below: -(L22^-1 L21) L11^-1, L22^-1 already in place
            below = L[e:, e:] @ L[e:, j:e]
            L[e:, j:e] = -(below @ diag_inv)
        L[j:e, j:e] = diag_inv
    return L


def _inverse_hessian_factor(
    W: torch.Tensor, hessian: torch.Tensor, damp_percent: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): U the upper Cholesky factor of the damped H^-1 (U^T U = H^-1; row i: the
    update coefficients for columns >= i), dead the inputs never active (their columns of W
    are zeroed, in place: they cannot matter).

    H^-1 is never formed: with J the reversal of the input order, J H J = L L^T gives
    H^-1 = (J L^-1 J)^T (J L^-1 J), and J L^-1 J is upper triangular. One Cholesky and one
    triangular inverse (K^3/3 + 2K^3/3 flops) where GPTQ's reference takes a Cholesky, the
    inverse from it and a second Cholesky (K^3/3 + 2K^3/3 + K^3/3), in LAPACK's slower
    kernels; two [K, K] matrices alive at a time, not three.
    """
    H = hessian.flip(0, 1).float()  # J H J (a copy)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(damp_percent * torch.diag(H).mean())  # (H + c I, no [K, K] identity)
    dead = dead.flip(0)
    W[:, dead] = 0.0
    L = torch.linalg.cholesky(H)
    del H
    return _lower_inverse_(L).flip(0, 1), dead


class SharedFactors:
    """The last H^-1 factor made, for the next linear fed the same Hessian sum (the same
    tensor: `HessianCollector` gives q/k/v one sum and gate/up another), so a decoder layer
    makes three or four factors, not seven. One entry, dropped before another is made."""

    def __init__(self):
        self._last: tuple | None = None  # (the sum, damp, U, dead)

    def factor(
        self, W: torch.Tensor, hessian: torch.Tensor, damp: float, release: bool = False
    ) -> torch.Tensor:
        """U for `hessian` (`_inverse_hessian_factor`), W's dead columns zeroed. `release`: the
        sum is the caller's to free once its factor exists (a streamed conversion's last use
        of it): its storage is emptied then, so the largest (down_proj's, 0.8 GB at 14,336
        inputs) is not alive beside its factor during the sweep; the linears sharing it read
        the factor kept here."""
        last = self._last
        if last is not None and last[0] is hessian and last[1] == damp:
            W[:, last[3]] = 0.0
            return last[2]
        self._last = None
        U, dead = _inverse_hessian_factor(W, hessian, damp)
        if release:
            hessian.set_()
        self._last = (hessian, damp, U, dead)
        return U


def _gptq_columns(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    block_size: int,
    round_column: Callable[[int, torch.Tensor, Callable[[], torch.Tensor]], torch.Tensor],
) -> None:
    """The GPTQ sweep over W [N, K] (updated in place).

    `round_column(col, w, remaining)` quantizes column `col` (its current values w [N]) and
    returns the dequantized column; `remaining()` gives the current W[:, col:] for grid fits.
    """
    K = W.shape[1]
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        # the block transposed, [B, N]: column i is row i, contiguous, and the lazy update of
        # the block's later columns is one rank-1 update of contiguous rows (BLAS ger)
        W1 = W[:, b0:b1].t().contiguous()
        err = torch.empty_like(W1)
        H1 = Hinv[b0:b1, b0:b1]
        with single_threaded():
            for i in range(b1 - b0):
                w = W1[i]
                deq = round_column(
                    b0 + i, w, lambda W1=W1, i=i, b1=b1: torch.cat([W1[i:].t(), W[:, b1:]], 1)
                )
                e = (w - deq) / H1[i, i]
                W1[i:].addr_(H1[i, i:], e, alpha=-1)  # W1[j] -= H1[i, j] e for j >= i
                err[i] = e
        W[:, b1:] -= err.t() @ Hinv[b0:b1, b1:]  # a real GEMM: all threads


def _int4_rounder(q, scale, zero, group_size: int):
    """round_column for the 4-bit grid (q [N, K], scale and zero [N, groups] filled): the
    group's asymmetric grid is fitted on the error-updated weights where a group starts (GPTQ's
    order), on the first N rows of what `remaining()` gives (the 4-bit copy comes first)."""
    rows = q.shape[0]

    def round_column(col, w, remaining):
        g = col // group_size
        if col % group_size == 0:
            _, s, z = rtn_quantize(remaining()[:rows, :group_size], group_size)
            scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
        s, z = scale[:, g], zero[:, g]
        qc = torch.clamp(torch.round(w / s) + z, 0, 15)
        q[:, col] = qc.to(torch.uint8)
        return (qc - z) * s

    return round_column


def _int8_rounder(q, scale):
    """round_column for the per-channel symmetric int8 grid (`scale` [N] fixed)."""

    def round_column(col, w, remaining):
        qc = torch.clamp(torch.round(w / scale), -127, 127)
        q[:, col] = qc.to(torch.int8)
        return qc * scale

    return round_column


def _sweep(
    weight,
    hessian,
    damp_percent: float,
    block_size: int,
    rounders: list,
    factors=None,
    release: bool = False,
) -> None:
    """GPTQ over len(rounders) copies of weight [N, K] stacked as [len * N, K], copy i rounded
    by rounders[i]. The copies share H^-1 and, row for row, every update (a row's GPTQ never
    reads another row), so one sweep does the work of several: the per-column Python once.
    `factors`: a `SharedFactors` the caller keeps across linears (None: one for this one);
    `release`: `SharedFactors.factor`'s."""
    W = weight.float().clone()
    N = W.shape[0]
    Hinv = (factors or SharedFactors()).factor(W, hessian, damp_percent, release)
    if len(rounders) == 1:
        _gptq_columns(W, Hinv, block_size, rounders[0])
        return

    def round_column(col, w, remaining):
        return torch.cat(
            [r(col, w[i * N : (i + 1) * N], remaining) for i, r in enumerate(rounders)]
        )

    _gptq_columns(torch.cat([W] * len(rounders)), Hinv, block_size, round_column)


def _int4_codes(weight: torch.Tensor, group_size: int):
    """Zeroed q uint8 [N, K], scale and zero fp32 [N, ceil(K/G)] for `_int4_rounder`."""
    N, K = weight.shape
    groups = n_groups(K, group_size)
    return torch.zeros(N, K, dtype=torch.uint8), torch.zeros(N, groups), torch.zeros(N, groups)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    damp_percent: float = 0.01,
    block_size: int = 128,
    factors: SharedFactors | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] (sum of x x^T over calibration inputs) -> q, scale, zero.

    Returns q uint8 [N, K] and fp32 scale/zero [N, ceil(K/G)], the same format as
    `rtn_quantize` (the last group is short when G does not divide K, as GPTQ's g_idx = k // G).
    """
    codes = _int4_codes(weight, group_size)
    _sweep(weight, hessian, damp_percent, block_size, [_int4_rounder(*codes, group_size)], factors)
    return codes


def gptq_quantize_int8(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    damp_percent: float = 0.01,
    block_size: int = 128,
    factors: SharedFactors | None = None,
    release: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] -> (q int8 [N, K], scale fp32 [N]) on the per-channel
    symmetric grid of `kernels.formats.quantize_int8` (same scales; GPTQ picks the rounding)."""
    from kernels.formats import quantize_int8

    _, scale = quantize_int8(weight)  # [N]: max|w|/127 (1 for an all-zero row)
    q = torch.zeros(weight.shape, dtype=torch.int8)
    _sweep(weight, hessian, damp_percent, block_size, [_int8_rounder(q, scale)], factors, release)
    return q, scale


def gptq_quantize_both(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    damp_percent: float = 0.01,
    block_size: int = 128,
    factors: SharedFactors | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`gptq_quantize` and `gptq_quantize_int8` of one layer in one sweep (`_sweep`):
    ((q, scale, zero), (q_int8, scale_int8)), one Cholesky and half the per-column Python
    (the default model's conversion: 70 -> 60 s on 2 cores)."""
    from kernels.formats import quantize_int8

    _, scale8 = quantize_int8(weight)
    q8 = torch.zeros(weight.shape, dtype=torch.int8)
    codes = _int4_codes(weight, group_size)
    rounders = [_int4_rounder(*codes, group_size), _int8_rounder(q8, scale8)]
    _sweep(weight, hessian, damp_percent, block_size, rounders, factors)
    return codes, (q8, scale8)


class HessianCollector(InputHooks):
    """Forward hooks that sum x^T x over the inputs of each linear layer (calibration)."""

    def __init__(self, layers: dict[str, torch.nn.Module]):
        self.hessians = {name: None for name in layers}
        self.tokens = 0
        # linears fed the very input tensor the previous one was (q/k/v, gate/up) share its
        # sum, one tensor: Llama-3.1-8B shapes hold 4 fewer [4,096, 4,096] sums per layer.
        # Weak references: holding down_proj's last input or its sum before would keep
        # 0.8 GB alive through the rounding.
        self._last: tuple | None = None  # (that input, its linear's name, its sum before)
        super().__init__(layers)

    def add(self, name: str, inputs: torch.Tensor) -> None:
        """Add the inputs [..., K] of layer `name` (what its hook sees) to its sum."""
        last, prev = self._last, self.hessians.get(name)
        if last is not None and last[0]() is inputs and (last[2] and last[2]()) is prev:
            self.hessians[name] = self.hessians[last[1]]  # (the same sum, already added to)
            return
        x = inputs.reshape(-1, inputs.shape[-1]).float()  # [n, K]
        h = 2 * x.t() @ x
        self.hessians[name] = h if prev is None else prev + h
        self._last = (weakref.ref(inputs), name, None if prev is None else weakref.ref(prev))
