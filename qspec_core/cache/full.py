"""The full-precision KV cache: the autoregressive baseline, and the prefill's scratch space."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels import MAX_STEP_ROWS
from kernels.attention import causal_attention
from kernels.cpu import kv_cache as cpu_kv
from kernels.reference import causal_mask, cuts, window_start
from qspec_core.cache.protocol import KVCache, layer_stacks, write_kv
from qspec_core.config import ModelConfig
from qspec_core.precision import FP, Precision

__all__ = ["FullPrecisionCache", "KVCache"]

# A local layer's stack holds window / LOCAL_ROOM_SHARE positions of room past its window and
# REWIND, so a drop (the window copied down to slot 0) comes once every that many decoded
# tokens: a copy of the window once every 64 tokens at Gemma 3's 512, 512 at Mistral's 4,096,
# about a thousandth of a step's bytes either way. A longer forward (a prefill chunk, a chat's
# question) grows the stack to what it needs, and the next forward that fits the decoding size
# shrinks it back: after a prompt a local layer holds window + REWIND + room positions.
LOCAL_ROOM_SHARE = 8
# How far back of a forward's first position a later one may start once a local layer has
# dropped keys: a speculative round's verify goes back over its drafts (at most MAX_DRAFTS).
REWIND = MAX_STEP_ROWS


@dataclass(frozen=True)
class FullCheckpoint:
    """`FullPrecisionCache.checkpoint()`: its length and the local layers' positions
    [local_base, seq_len) (None without local layers), which later drops overwrite."""

    seq_len: int
    local_base: int = 0
    local_k: torch.Tensor | None = None
    local_v: torch.Tensor | None = None


class FullPrecisionCache(torch.nn.Module):
    """Preallocated full-precision K/V for all layers: the autoregressive baseline.

    It serves the "fp" KV view, with any weights (4-bit weights over it: the draft-w4 ablation).

    Writing at positions p..q makes q + 1 the new length, so a write below the current
    length (a verify step over rejected draft positions) also rolls back what lay beyond.

    Sliding-window layers keep their K/V in a stack of their own, `local_k`/`local_v`
    [Ll, B, n_kv, window + REWIND + room, D], slot 0 holding position `local_base`: a
    forward that would run past its end first drops the keys no query of it (nor of a
    forward up to REWIND positions back) sees, so a local layer's memory is O(window), not
    O(context). Rolling back further than that (`rewind_floor`) needs a `checkpoint`.
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
        self.windows = config.windows  # each layer's sliding window (None: global)
        self._local, self._slot = layer_stacks(self.windows)
        self.window = max((w for w in self.windows if w is not None), default=None)
        self.room = max(1, (self.window or 0) // LOCAL_ROOM_SHARE)  # (see LOCAL_ROOM_SHARE)
        B, n_kv, D = batch_size, config.num_key_value_heads, config.head_dim

        def buf(name, layers, S):  # [layers, B, n_kv, S, D]
            t = torch.zeros(layers, B, n_kv, S, D, dtype=dtype, device=device)
            self.register_buffer(name, t, persistent=False)

        n_local = self._local.count(True)
        buf("k", len(self._local) - n_local, max_seq_len)  # the global layers'
        buf("v", len(self._local) - n_local, max_seq_len)
        if n_local:
            buf("local_k", n_local, self._local_capacity(max_seq_len))
            buf("local_v", n_local, self._local_capacity(max_seq_len))
        self.local_base = 0  # the position a local layer's slot 0 holds
        self.max_seq_len = max_seq_len
        self.rope_capacity = rope_capacity or max_seq_len  # (KVCache: `grow` keeps it)
        self.softcap = config.attn_logit_softcapping  # (Gemma 2's; None: none)
        self.seq_len = 0
        # (positions key, {window: (first key, positions, mask)}): once per forward and
        # window (`_keys`), not per layer
        self._mask: tuple = (None, {})
        self.attention_seconds = 0.0  # wall time inside `attend`'s attention (a prefill's stage)
        self._native = cpu_kv.NativeMemo()  # the C++ `FullKV` over k and v
        # a prefill chunk's attention products on a CPU (`kernels.cpu.attention.PRODUCTS`): the
        # runner's choice (`runner/kernel_table.prefill_attention`), handed in by the engine
        self.products = products

    def _local_capacity(self, max_seq_len: int) -> int:
        return min(max_seq_len, self.window + REWIND + self.room)

    def _stack(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A layer's (k, v) [B, n_kv, S, D] in its stack and the position its slot 0 holds."""
        if self._local[layer]:
            slot = self._slot[layer]
            return self.local_k[slot], self.local_v[slot], self.local_base
        return self.k[self._slot[layer]], self.v[self._slot[layer]], 0

    def attend(self, layer, q, k, v, input_pos, path: Precision = FP):
        if path.kv != "fp":
            raise ValueError(f"the full-precision cache serves the 'fp' KV view, not {path.kv!r}")
        start, end = self._span(input_pos)
        self._put(layer, k, v, start)
        if layer == len(self.windows) - 1:
            self.seq_len = end
        window = self.windows[layer]
        lo, positions, mask = self._keys(input_pos, start, end, window)
        keys, values, base = self._stack(layer)
        k_all, v_all = keys[:, :, lo - base : end - base], values[:, :, lo - base : end - base]
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
        self._make_room(start, end)
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

    @property
    def rewind_floor(self) -> int:
        """The shortest length `truncate` goes back to: past it, a local layer's window
        reaches keys it has dropped (0 without local layers, or before any drop)."""
        return self.local_base + self.window - 1 if self.local_base else 0

    def _make_room(self, start: int, end: int) -> None:
        """Room in the local stack for a forward at [start, end): the keys before what it,
        or a forward up to REWIND positions back, sees are dropped (the rest moved down to
        slot 0). A forward longer than the room grows the stack; the first one after it that
        fits the decoding size (`_local_capacity`) shrinks it back."""
        if self.window is None:
            return
        if start < self.rewind_floor:
            raise ValueError(
                f"a forward at {start} reads keys dropped below {self.local_base} (the local "
                f"layers keep {self.window} positions back from {self.rewind_floor})"
            )
        held, size = self.local_k.shape[3], self._local_capacity(self.max_seq_len)
        keep = max(self.local_base, window_start(start, self.window) - REWIND)
        need = end - keep  # (what this forward's stack must hold, after the drop)
        S = size if need <= size else max(held, need)  # decoding's size, or this forward's
        n, shift = start - keep, keep - self.local_base
        if S != held:
            self._resize_local(S, shift, n)
        elif end - self.local_base > held:
            for t in (self.local_k, self.local_v):  # (clone: the two ranges may overlap)
                t[:, :, :, :n] = t[:, :, :, shift : shift + n].clone()
        else:
            return  # (it fits as it is)
        self.local_base = keep

    def _resize_local(self, S: int, shift: int = 0, n: int | None = None) -> None:
        """The local stack reallocated to S positions, holding the n it held from slot
        `shift` on (all it held, by default) from slot 0."""
        for name in ("local_k", "local_v"):
            old = getattr(self, name)
            with torch.inference_mode(False):  # (still writable after an inference-mode prefill)
                new = old.new_zeros(*old.shape[:3], S, old.shape[4])
                keep = min(S, old.shape[3] - shift) if n is None else n
                new[:, :, :, :keep] = old[:, :, :, shift : shift + keep]
            setattr(self, name, new)

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Writes k/v [B, n_kv, T, D] at positions [start, start + T): through the C++
        `FullKV` where there is one (`write_kv`)."""
        local = self._local[layer]
        keys, values = (self.local_k, self.local_v) if local else (self.k, self.v)
        base = self.local_base if local else 0
        write_kv(self.native, keys, values, layer, k, v, start, self._slot[layer], base)

    @property
    def native(self):
        """The C++ `FullKV` over k/v (`kernels/cpu/kv_cache.py`), made on first use and again
        when a buffer is replaced (`grow`, `.to()`); None off the CPU, for k/v not fp32, or
        before a runner has loaded the kernels."""
        names = ("k", "v", "local_k", "local_v") if self.window is not None else ("k", "v")
        buffers = tuple(self._buffers[name] for name in names)
        if not cpu_kv.usable(*buffers):
            return None

        def make():
            local = buffers[2:] if self.window is not None else ()
            slots = self._slot if self.window is not None else ()
            return cpu_kv.full_kv(buffers[0], buffers[1], self.windows, self.softcap, local, slots)

        return self._native.get(buffers, make)

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
        if self.local_base:
            step["local_base"] = self.local_base
        window = next((w for w in self.windows if cuts(w, end)), None)  # (one for all locals)
        if window is not None:
            lo, _, local_mask = self._keys(input_pos, start, end, window)
            step |= dict(local_start=lo, local_mask=local_mask)
        return cpu_kv.full_step(**step)

    def truncate(self, length: int) -> None:
        if not self.rewind_floor <= length <= self.seq_len:
            floor = self.rewind_floor
            raise ValueError(
                f"cannot truncate a cache of length {self.seq_len} to {length}"
                + (f" (its local layers go back to {floor})" if 0 <= length < floor else "")
            )
        self.seq_len = length

    def commit(self, length: int) -> None:
        """Nothing to do: a full-precision cache never quantizes."""
        if length > self.seq_len:
            raise ValueError(f"cannot commit {length} positions of a cache of {self.seq_len}")

    def checkpoint(self) -> FullCheckpoint:
        """A way back to this state past `rewind_floor` (a chat's document end): positions
        below seq_len are never rewritten before a rollback to them, so only the local
        layers' (a window's worth, which later drops overwrite) are kept."""
        if self.window is None:
            return FullCheckpoint(self.seq_len)
        n = self.seq_len - self.local_base
        lk, lv = self.local_k[:, :, :, :n].clone(), self.local_v[:, :, :, :n].clone()
        return FullCheckpoint(self.seq_len, self.local_base, lk, lv)

    def restore(self, point: FullCheckpoint) -> None:
        """Return to `point`'s state exactly; whatever came after it is dropped."""
        if point.local_k is not None:
            n = point.local_k.shape[3]
            if n > self.local_k.shape[3]:
                self._resize_local(n + self.room)
            self.local_k[:, :, :, :n] = point.local_k
            self.local_v[:, :, :, :n] = point.local_v
            self.local_base = point.local_base
        self.seq_len = point.seq_len

    def grow(self, max_seq_len: int) -> None:
        """Reallocate to a larger capacity, keeping the valid positions."""
        if max_seq_len <= self.max_seq_len:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], max_seq_len, old.shape[4])
            new[:, :, :, : self.seq_len] = old[:, :, :, : self.seq_len]
            setattr(self, name, new)
        if self.window is not None and self._local_capacity(max_seq_len) > self.local_k.shape[3]:
            self._resize_local(self._local_capacity(max_seq_len))
        self.max_seq_len = max_seq_len

    def reset(self) -> None:
        self.seq_len = 0
        self.local_base = 0

    def nbytes(self) -> dict[str, int]:
        """Bytes the valid positions occupy (the preallocated capacity is `capacity_nbytes`):
        a global layer's every position, a local layer's from local_base on."""
        held = 2 * self.k[:, :, :, 0].numel() * self.k.element_size() * self.seq_len
        if self.window is not None:
            per_pos = 2 * self.local_k[:, :, :, 0].numel() * self.local_k.element_size()
            held += per_pos * (self.seq_len - self.local_base)
        return {"payload": 0, "scales": 0, "full_precision": held}

    def bytes_per_token(self) -> float:
        """Bytes a step reads per history token over all layers and KV heads (a local
        layer's: within its window; `bench.bandwidth.kv_read_positions`)."""
        B, n_kv, _, D = self.k.shape[1:]
        return 2 * len(self.windows) * B * n_kv * D * self.k.element_size()

    def capacity_nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers())
