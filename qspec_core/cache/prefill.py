"""QuantSpec's prefill, quantizing as it goes: a prompt's KV enters the hierarchical cache's
planes chunk by chunk, so a long document never holds all of its KV in full precision.

`prefill_hierarchical` (`engine/generate.py`) feeds the prompt in chunks of C tokens (512);
`ChunkedPrefill` is the cache of those forwards. Per layer it keeps the positions not yet
quantized in a full-precision tail (fewer than C + 2G tokens) and, after each chunk, moves
every whole group of G tokens below max(0, (end // G - 1) G) into the cache's planes
(`HierarchicalKVCache.append_quantized`; prompt tokens are given, hence confirmed). When the
prompt is in, the tail (the last G..2G tokens) becomes the cache's full-precision region:
the cache ends exactly as a bulk load (`load_full_precision`) of the same K/V leaves it.

What a chunk's queries see: the quantized history in the target's view (INT8: both planes,
dequantized by the reference's formulas, `kernels/planes.py`), then the tail and the chunk in
full precision, causally; the tiled C++ kernel computes it on a CPU
(`kernels.attention.causal_attention`). A query at position p thus sees at least as much in
full precision as the target path gives it in decoding (which quantizes up to
(p // G - 1) G), and a prompt of one chunk is attended exactly as before, all in full
precision. The kernel's products are the runner's choice, handed in (`products`; the engine
gives those measured fastest on the machine, `runner/kernel_table.prefill_attention`): fp32,
or integer or bf16 ones that move the next-token law less than the INT8 history does. The
paper's prefill attends over the whole prompt in full precision, which needs a full-precision
copy of all of it: [L, n_kv, S, D] twice, 0.4 GB for SmolLM2 at 8k, 0.8 GB for Qwen2.5-0.5B at
32k.

Memory beside the cache: the tail, [L, B, n_kv, C + 2G, D] twice, and while one layer
attends its dequantized history, [B, n_kv, S, D] twice (1/L of that full-precision copy).
"""

from __future__ import annotations

import time

import torch

from kernels.attention import causal_attention
from kernels.cpu.attention import prefill_usable
from kernels.reference import causal_mask, cuts, window_start
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.precision import FP, Precision


class ChunkedPrefill:
    """The KV cache of a prefill into `cache` (empty), in chunks of at most `chunk_size`
    tokens fed in order; `finish()` hands the last tokens to `cache` (see the module doc)."""

    def __init__(self, cache: HierarchicalKVCache, chunk_size: int, products: str = "fp32"):
        if cache.seq_len:
            raise ValueError("a chunked prefill fills an empty cache (reset it first)")
        L, B, n_kv, _, D = cache.fp_k.shape
        G = cache.group_size
        self.cache = cache
        self.max_seq_len = cache.max_seq_len
        self.rope_capacity = cache.rope_capacity
        # positions [n_quant, n_quant + tail_len) per layer: at most 2G - 1 left from the last
        # chunk plus the chunk being fed
        capacity = chunk_size + 2 * G
        like = cache.fp_k
        self.tail_k = like.new_zeros(L, B, n_kv, capacity, D)  # [L, B, n_kv, C + 2G, D]
        self.tail_v = like.new_zeros(L, B, n_kv, capacity, D)
        self.tail_len = [0] * L
        self.seq_len = 0
        self.attention_seconds = 0.0  # attention, with the history's dequantization
        self.quantize_seconds = 0.0  # the groups' quantization into the planes
        # (input_pos, memo) of the forward being run: its relative positions and masks
        self._forward: tuple = (None, {})
        # the tiled CPU attention's products (`kernels.cpu.attention.PRODUCTS`; off a CPU unused)
        self.products = products

    def attend(self, layer, q, k, v, input_pos, path: Precision = FP) -> torch.Tensor:
        """Store k/v [B, n_kv, T, D] at input_pos [T] (the next positions of this layer) and
        return q [B, H, T, D]'s causal attention over every position so far."""
        if path.kv != "fp":
            raise ValueError(f"a prefill's forward reads the 'fp' KV view, not {path.kv!r}")
        start, end = self._span(input_pos)
        nq, n = self.cache.n_quant[layer], self.tail_len[layer]
        if start != nq + n:
            raise ValueError(f"a prefill feeds its positions in order: {nq + n} next, not {start}")
        lo, hi = start - nq, end - nq
        if hi > self.tail_k.shape[3]:
            raise ValueError(f"a chunk of {end - start} tokens exceeds the prefill's chunk size")
        self.tail_k[layer, :, :, lo:hi] = k
        self.tail_v[layer, :, :, lo:hi] = v
        self.tail_len[layer] = hi
        t0 = time.perf_counter()
        # a local layer reads (and dequantizes) its history from the group holding the oldest
        # position its chunk sees: a window's worth per chunk, not the context
        window, G = self.cache.windows[layer], self.cache.group_size
        first = 0 if not cuts(window, end) else min(nq, window_start(start, window) // G * G)
        keys, values = self._keys(layer, hi, first)
        positions, _ = self._relative(input_pos, first)
        tiled = prefill_usable(q, keys, values)
        mask = None if tiled else self._causal_mask(input_pos, first, window)
        cap = self.cache.softcap
        out = causal_attention(q, keys, values, positions, mask, cap, self.products, window)
        t1 = time.perf_counter()
        self._quantize(layer, end)
        self.quantize_seconds += time.perf_counter() - t1
        self.attention_seconds += t1 - t0
        if layer == len(self.tail_len) - 1:
            self.seq_len = end
        return out

    def _keys(self, layer: int, n: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [B, n_kv, n_quant - first + n, D]: the history from position `first` (a
        multiple of G) dequantized (INT8), then the tail's n."""
        tail_k, tail_v = self.tail_k[layer, :, :, :n], self.tail_v[layer, :, :, :n]
        nq = self.cache.n_quant[layer]
        if nq == first:
            return tail_k, tail_v
        B, n_kv, _, D = tail_k.shape
        h = nq - first
        keys = tail_k.new_empty(B, n_kv, h + n, D, dtype=torch.float32)
        values = torch.empty_like(keys)
        self.cache.dequantize_into(layer, keys[:, :, :h], values[:, :, :h], "int8", first)
        keys[:, :, h:], values[:, :, h:] = tail_k, tail_v
        dtype = tail_k.dtype  # (a bf16 cache's prefill attends in bf16, as before)
        return keys.to(dtype), values.to(dtype)

    def _quantize(self, layer: int, end: int) -> None:
        """Move the whole groups below `end`'s boundary from the tail into the planes."""
        G, nq = self.cache.group_size, self.cache.n_quant[layer]
        n = max(0, (end // G - 1) * G) - nq
        if n <= 0:
            return
        tail_k, tail_v = self.tail_k[layer, :, :, :n], self.tail_v[layer, :, :, :n]
        self.cache.append_quantized(layer, tail_k, tail_v)
        rest = self.tail_len[layer] - n
        for tail in (self.tail_k, self.tail_v):
            tail[layer, :, :, :rest] = tail[layer, :, :, n : n + rest].clone()
        self.tail_len[layer] = rest

    def _span(self, input_pos: torch.Tensor) -> tuple[int, int]:
        """(first position, last + 1) of a forward, checked."""
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} is beyond the cache ({self.max_seq_len})")
        return start, end

    def _relative(self, input_pos: torch.Tensor, first: int) -> tuple[torch.Tensor, int]:
        """(input_pos - first, the keys [first, end) they see), once per forward and first."""
        if not first:
            return input_pos, int(input_pos[-1]) + 1
        memo = self._memo(input_pos)
        if ("positions", first) not in memo:
            memo["positions", first] = (input_pos - first, int(input_pos[-1]) + 1 - first)
        return memo["positions", first]

    def _causal_mask(self, input_pos: torch.Tensor, first: int, window: int | None):
        """The reference's [T, S] mask over keys [first, end) (a local layer's: within its
        `window`), made once per forward, window and first key, not per layer (the C++ kernel
        needs none)."""
        memo = self._memo(input_pos)
        if ("mask", first, window) not in memo:
            memo["mask", first, window] = causal_mask(*self._relative(input_pos, first), window)
        return memo["mask", first, window]

    def _memo(self, input_pos: torch.Tensor) -> dict:
        """The memo of the forward of `input_pos` (every layer of a forward gets the same
        tensor), new when a new forward begins."""
        if self._forward[0] is not input_pos:
            self._forward = (input_pos, {})
        return self._forward[1]

    def finish(self) -> None:
        """The prompt is in: its last tokens become the cache's full-precision region, every
        position committed."""
        if len(set(self.tail_len)) != 1 or len(set(self.cache.n_quant)) != 1:
            raise RuntimeError("the prefill's layers are out of step (an interrupted forward)")
        for layer, n in enumerate(self.tail_len):
            tail_k, tail_v = self.tail_k[layer, :, :, :n], self.tail_v[layer, :, :, :n]
            self.cache.set_recent(layer, tail_k, tail_v)
        self.cache.commit(self.seq_len)

    def commit(self, length: int) -> None:
        """Nothing to do: a prompt's tokens are confirmed, and `finish` commits them."""
        if length > self.seq_len:
            raise ValueError(f"cannot commit {length} positions of a prefill of {self.seq_len}")

    def truncate(self, length: int) -> None:
        if length != self.seq_len:
            raise ValueError("a prefill never rolls back")

    def nbytes(self) -> dict[str, int]:
        held = self.cache.nbytes()
        held["full_precision"] += self.tail_k.nbytes + self.tail_v.nbytes
        return held
