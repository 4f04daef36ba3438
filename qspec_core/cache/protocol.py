"""The KV cache protocol: the seam between the model and K/V storage.

The model never touches K/V tensors after projecting them: each attention layer hands its new
keys and values to `cache.attend(...)`, which stores them and returns the attention output in
the KV view the forward's `Precision.kv` names ("fp", "int8", "int4"). That call is the seam
where the hierarchical INT4/INT8 cache plugs in: it decides what it stores (full precision,
packed planes) and which planes the attention reads.

A cache may also offer `step_plan(input_pos, path, n_tokens)`: for a decode-sized forward
on CPU it does every layer's bookkeeping at once and returns what the C++ stack reads of it
(`FullStep`, `HierStep`), so that the CPU runner runs all layers in one C++ call
(`qspec_core/runner/cpu.py`); or None to go layer by layer through `attend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qspec_core.precision import Precision


class KVCache(Protocol):
    """What the model and the generators need from a cache."""

    seq_len: int  # positions [0, seq_len) hold valid K/V
    max_seq_len: int

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        input_pos: torch.Tensor,
        path: Precision,
    ) -> torch.Tensor:
        """Store k/v [B, n_kv, T, D] at `input_pos` [T]; return attention of q [B, H, T, D]
        in the KV view `path.kv` names (a cache raises ValueError for a view it lacks)."""
        ...

    def truncate(self, length: int) -> None:
        """Forget every position >= length (rollback)."""
        ...

    def commit(self, length: int) -> None:
        """Positions < length are confirmed by the target path (only those may be quantized)."""
        ...

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split by kind (payload, scales, full-precision buffer)."""
        ...


@dataclass(frozen=True)
class FullStep:
    """A full-precision cache for one step: k/v [L, B, n_kv, S, D] fp32, the step's positions
    [start, end), and its attention mask (None with `is_causal`, or for one newest query)."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    end: int
    mask: torch.Tensor | None
    is_causal: bool


@dataclass(frozen=True)
class HierStep:
    """A hierarchical cache for one step, as `DecoderStack.run_hier` reads it: the buffers
    (planes, scales, zeros of K then V, then fp_k, fp_v; all layers), where the step's tokens
    sit in the full-precision region [lo, hi), the quantized length, each query's quantized
    length and F1 shift (late queries, see `cache/hierarchical.py`), and the view."""

    buffers: list[torch.Tensor]
    lo: int
    hi: int
    n_quant: int
    n_quant_q: torch.Tensor  # [T] int64
    shift: torch.Tensor  # [T] int64
    input_pos: torch.Tensor  # [T]
    int8: bool  # both planes (the target's view), else the upper plane only
    int_queries: bool  # queries rounded to int16, integer-dot scores (`Precision.int_queries`)
    group_size: int
    chunk_size: int
