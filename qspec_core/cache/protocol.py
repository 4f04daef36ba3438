"""The KV cache protocol: the seam between the model and K/V storage.

The model never touches K/V tensors after projecting them: each attention layer hands its new
keys and values to `cache.attend(...)`, which stores them and returns the attention output in
the KV view the forward's `Precision.kv` names ("fp", "int8", "int4"). That call is the seam
where the hierarchical INT4/INT8 cache plugs in: it decides what it stores (full precision,
packed planes) and which planes the attention reads.

A cache may also have a C++ side (`kernels/cpu/kv_cache.py`), the one thing that crosses
the line to the CPU kernels: `cache.native`, a C++ object over the cache's own buffers (the
hierarchical cache's `HierKV`, the full-precision cache's `FullKV`; None off the CPU, for
buffers not fp32, or before a CPU runner loaded the kernels), which writes a forward's new
K/V into them and attends over them; and `cache.native_step(input_pos, path, n_tokens)`,
which does every layer's bookkeeping of a decode-sized forward at once and returns its named
step (`HierStep`, `FullStep`), or None to go layer by layer through `attend`. The CPU runner
hands the object and the step to `DecoderStack.run`, which runs all layers in one C++ call
(`qspec_core/runner/cpu.py`); the cache's own `attend` writes through the same object, so a
cache's buffers have one writer whichever loop runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qspec_core.precision import Precision


@dataclass(frozen=True)
class CacheCheckpoint:
    """`HierarchicalKVCache.checkpoint()`: lengths and the full-precision region
    fp_k/fp_v [L, B, n_kv, fp_len, D] at that point; with sliding-window layers, their planes
    too (`local`: the local stack's buffers by name, positions [local_base, n_quant), which
    later drops may move or overwrite)."""

    n_quant: int
    fp_len: int
    fp_k: torch.Tensor
    fp_v: torch.Tensor
    local_base: int = 0
    local: dict[str, torch.Tensor] | None = None


class KVCache(Protocol):
    """What the model and the generators need from a cache."""

    seq_len: int  # positions [0, seq_len) hold valid K/V
    max_seq_len: int
    # the capacity the cache was made with: LongRoPE's choice of factors for the sequence
    # (model/rope.py), kept when a cache grows and in snapshots
    rope_capacity: int

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
        """Forget every position >= length (rollback), for length >= `rewind_floor`."""
        ...

    @property
    def rewind_floor(self) -> int:
        """The shortest length `truncate` goes back to (a quantized or dropped history below;
        `checkpoint()` and `restore(point)` go back further)."""
        ...

    def commit(self, length: int) -> None:
        """Positions < length are confirmed by the target path (only those may be quantized)."""
        ...

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split by kind (payload, scales, full-precision buffer)."""
        ...


def write_kv(native, keys: torch.Tensor, values: torch.Tensor, layer: int, k, v, start: int,
             slot: int | None = None, base: int = 0):  # fmt: skip
    """Writes a forward's k/v [B, n_kv, T, D] at positions [start, start + T) of one layer of
    the buffers `keys`/`values` [L, B, n_kv, S, D]: through the cache's C++ object `native`
    where there is one (the very object the C++ stack writes through: one writer per cache),
    else by slice assignment. A layer in a stack of its own: `slot`, its index there, and
    `base`, the position its slot 0 holds (the full cache's local layers)."""
    if native is not None:
        if base:  # (`FullKV`'s local stack; a `HierKV` never gets one)
            native.write(layer, k, v, start, base)
        else:
            native.write(layer, k, v, start)
        return
    first = start - base
    end = first + k.shape[2]
    slot = layer if slot is None else slot
    keys[slot, :, :, first:end] = k
    values[slot, :, :, first:end] = v


def layer_stacks(windows) -> tuple[list[bool], list[int]]:
    """Where each layer's K/V live in a cache with a stack for the sliding-window layers:
    (is_local [L], each layer's index in its stack [L]), from `ModelConfig.windows`."""
    local = [w is not None for w in windows]
    return local, [local[:i].count(local[i]) for i in range(len(local))]
