"""KV caches behind one small protocol.

The model never touches K/V tensors after projecting them: each attention layer hands its new
keys and values to `cache.attend(...)`, which stores them and returns the attention output.
That call is the seam where the hierarchical INT4/INT8 cache plugs in: it decides what it
stores (full precision, packed planes) and which view (`path`) the attention reads.

A cache may also offer `cpu_step(input_pos, path, n_tokens)`: for a decode-sized forward on
CPU it does every layer's bookkeeping at once and returns a function that runs all layers in
one C++ call (`qspec_core/cpu_step.py`), or None to go layer by layer through `attend`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.reference import causal_attention, causal_mask
from qspec_core.config import ModelConfig

# fp: full-precision weights and KV; target/draft: QuantSpec's two paths (INT8 / INT4 KV view,
# full / 4-bit weights); draft-kv4: full-precision weights over the INT4 view (an ablation).
PATHS = ("fp", "target", "draft", "draft-kv4")


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
        path: str,
    ) -> torch.Tensor:
        """Store k/v [B, n_kv, T, D] at `input_pos` [T]; return attention of q [B, H, T, D]."""
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


class FullPrecisionCache(torch.nn.Module):
    """Preallocated full-precision K/V for all layers: the autoregressive baseline.

    It serves every path with full-precision KV ("draft" then means 4-bit weights only).

    Writing at positions p..q makes q + 1 the new length, so a write below the current
    length (a verify step over rejected draft positions) also rolls back what lay beyond.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_seq_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        shape = (
            config.num_hidden_layers,
            batch_size,
            config.num_key_value_heads,
            max_seq_len,
            config.head_dim,
        )  # [L, B, n_kv, S, D]
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_seq_len = max_seq_len
        self.seq_len = 0
        self._mask = (None, None)  # (positions key, mask): built once per forward, not per layer

    def attend(self, layer, q, k, v, input_pos, path="fp"):
        # Every path reads full-precision KV here: with path="draft" this is the draft-w4
        # ablation (4-bit weights, full-precision KV).
        if path not in PATHS or path == "draft-kv4":
            raise ValueError(
                f"the full-precision cache serves 'fp', 'target' and 'draft', not {path!r}"
            )
        start, end = self._span(input_pos)
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if layer == self.k.shape[0] - 1:
            self.seq_len = end
        k_all, v_all = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        return causal_attention(q, k_all, v_all, input_pos, self._mask[1])

    def _span(self, input_pos: torch.Tensor) -> tuple[int, int]:
        """(first position, last + 1) of a forward's input_pos, checked; builds its mask."""
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} is beyond the cache ({self.max_seq_len})")
        if start > self.seq_len:
            raise ValueError(f"write at {start} leaves a gap after length {self.seq_len}")
        key = (start, end)
        if self._mask[0] != key:
            self._mask = (key, causal_mask(input_pos, end))
        return start, end

    def cpu_step(self, input_pos: torch.Tensor, path: str, n_tokens: int):
        """For a decode-sized forward on CPU: `run(stack, x, cos, sin)`, all layers in one C++
        call (`qspec_core/cpu_step.py`) with the attention `causal_attention` computes; None
        when this forward goes layer by layer (a cache not fp32 on CPU, a bad path)."""
        if path not in PATHS or path == "draft-kv4":
            return None  # (`attend` raises)
        if self.k.dtype != torch.float32 or self.k.device.type != "cpu":
            return None
        start, end = self._span(input_pos)
        self.seq_len = end
        # causal_attention's cases: the whole sequence at once is plain causal; one query at
        # the newest position sees every key (no mask); else the mask
        is_causal = n_tokens == end and start == 0
        mask = None if is_causal else self._mask[1]
        k, v = self.k, self.v

        def run(stack, x, cos, sin):
            return stack.run_full(x, cos, sin, k, v, start, end, mask, is_causal)

        return run

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot truncate a cache of length {self.seq_len} to {length}")
        self.seq_len = length

    def commit(self, length: int) -> None:
        """Nothing to do: a full-precision cache never quantizes."""
        if length > self.seq_len:
            raise ValueError(f"cannot commit {length} positions of a cache of {self.seq_len}")

    def grow(self, max_seq_len: int) -> None:
        """Reallocate to a larger capacity, keeping the valid positions."""
        if max_seq_len <= self.max_seq_len:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], max_seq_len, old.shape[4])
            new[:, :, :, : self.seq_len] = old[:, :, :, : self.seq_len]
            setattr(self, name, new)
        self.max_seq_len = max_seq_len

    def reset(self) -> None:
        self.seq_len = 0

    def nbytes(self) -> dict[str, int]:
        """Bytes the valid positions occupy (the preallocated capacity is `capacity_nbytes`)."""
        per_pos = 2 * self.k[:, :, :, 0].numel() * self.k.element_size()
        return {"payload": 0, "scales": 0, "full_precision": per_pos * self.seq_len}

    def capacity_nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
