"""The full-precision KV cache: the autoregressive baseline, and the prefill's scratch space."""

from __future__ import annotations

import time

import torch

from kernels.attention import causal_attention
from kernels.cpu import kv_cache as cpu_kv
from kernels.reference import causal_mask, cuts, window_start
from qspec_core.cache.protocol import KVCache, write_kv
from qspec_core.config import ModelConfig
from qspec_core.precision import FP, Precision

__all__ = ["FullPrecisionCache", "KVCache"]


class FullPrecisionCache(torch.nn.Module):
    """Preallocated full-precision K/V for all layers: the autoregressive baseline.

    It serves the "fp" KV view, with any weights (4-bit weights over it: the draft-w4 ablation).

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
        rope_capacity: int | None = None,
        products: str = "fp32",
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
        self.rope_capacity = rope_capacity or max_seq_len  # (KVCache: `grow` keeps it)
        self.softcap = config.attn_logit_softcapping  # (Gemma 2's; None: none)
        self.windows = config.windows  # each layer's sliding window (None: global)
        self.seq_len = 0
        # (positions key, {window: (first key, positions, mask)}): once per forward and
        # window (`_keys`), not per layer
        self._mask: tuple = (None, {})
        self.attention_seconds = 0.0  # wall time inside `attend`'s attention (a prefill's stage)
        self._native = cpu_kv.NativeMemo()  # the C++ `FullKV` over k and v
        # a prefill chunk's attention products on a CPU (`kernels.cpu.attention.PRODUCTS`): the
        # runner's choice (`runner/kernel_table.prefill_attention`), handed in by the engine
        self.products = products

    def attend(self, layer, q, k, v, input_pos, path: Precision = FP):
        if path.kv != "fp":
            raise ValueError(f"the full-precision cache serves the 'fp' KV view, not {path.kv!r}")
        start, end = self._span(input_pos)
        self._put(layer, k, v, start)
        if layer == self.k.shape[0] - 1:
            self.seq_len = end
        window = self.windows[layer]
        lo, positions, mask = self._keys(input_pos, start, end, window)
        k_all, v_all = self.k[layer, :, :, lo:end], self.v[layer, :, :, lo:end]
        t0 = time.perf_counter()
        # (`products` run a prefill's chunk on a CPU; a decode or verify step takes its own)
        out = causal_attention(
            q, k_all, v_all, positions, mask, self.softcap, self.products, window
        )
        self.attention_seconds += time.perf_counter() - t0
        return out

    def _span(self, input_pos: torch.Tensor) -> tuple[int, int]:
        """(first position, last + 1) of a forward's input_pos, checked; builds its mask."""
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} is beyond the cache ({self.max_seq_len})")
        if start > self.seq_len:
            raise ValueError(f"write at {start} leaves a gap after length {self.seq_len}")
        key = (start, end)
        if self._mask[0] != key:
            self._mask = (key, {None: (0, input_pos, causal_mask(input_pos, end))})
        return start, end

    def _keys(self, input_pos: torch.Tensor, start: int, end: int, window: int | None):
        """(lo, positions, mask) of this forward for a layer of sliding `window`: it reads keys
        [lo, end) (lo the oldest position any of its queries sees: 0 for a global layer, so a
        local layer's step reads `window` keys, not the context), with the queries' positions
        and mask relative to lo; made once per forward and window."""
        if not cuts(window, end):
            return self._mask[1][None]
        masks = self._mask[1]
        if window not in masks:
            lo = window_start(start, window)
            positions = input_pos - lo
            masks[window] = (lo, positions, causal_mask(positions, end - lo, window))
        return masks[window]

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Writes k/v [B, n_kv, T, D] at positions [start, start + T): through the C++
        `FullKV` where there is one (`write_kv`)."""
        write_kv(self.native, self.k, self.v, layer, k, v, start)

    @property
    def native(self):
        """The C++ `FullKV` over k/v (`kernels/cpu/kv_cache.py`), made on first use and again
        when a buffer is replaced (`grow`, `.to()`); None off the CPU, for k/v not fp32, or
        before a runner has loaded the kernels."""
        buffers = (self._buffers["k"], self._buffers["v"])
        if not cpu_kv.usable(*buffers):
            return None
        return self._native.get(
            buffers, lambda: cpu_kv.full_kv(*buffers, self.windows, self.softcap)
        )

    def native_step(self, input_pos: torch.Tensor, path: Precision, n_tokens: int):
        """For a forward of `native`'s C++ stack: the `FullStep` (`kernels/cpu/kv_cache.h`:
        the attention `causal_attention` computes, soft cap and windows included: a local
        layer's keys from `_keys`' lo under its mask), its length bookkeeping done; None when
        this forward goes layer by layer (no `native`, a KV view other than "fp")."""
        if path.kv != "fp" or self.native is None:
            return None  # (`attend` raises for another view)
        start, end = self._span(input_pos)
        self.seq_len = end
        # causal_attention's cases: the whole sequence at once is plain causal; one query at
        # the newest position sees every key (no mask); else the mask
        is_causal = n_tokens == end and start == 0
        mask = None if is_causal else self._mask[1][None][2]
        step = dict(start=start, end=end, mask=mask, is_causal=is_causal)
        window = next((w for w in self.windows if cuts(w, end)), None)  # (one for all locals)
        if window is not None:
            lo, _, local_mask = self._keys(input_pos, start, end, window)
            step |= dict(local_start=lo, local_mask=local_mask)
        return cpu_kv.full_step(**step)

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
