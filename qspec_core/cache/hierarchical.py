"""The hierarchical INT4/INT8 KV cache with a double full-precision buffer (QuantSpec).

One cache serves both paths. Per layer it holds
  - the quantized history, positions [0, n_quant): packed upper and lower nibble planes with
    K per-channel metadata (one scale/zero per channel per G tokens) and V per-token metadata
    (one scale/zero per token per G channels), see `kernels/planes.py`;
  - the full-precision region, positions [n_quant, n_quant + fp_len), capacity 2G: F1 (the
    oldest G, confirmed, waiting to fill a whole K group) and F2 (recent and unverified).
A forward's `Precision` picks the KV view by `path.kv`: "int4" reads the upper plane (the
draft), "int8" both planes (the target); both read the same F1/F2. On a CPU where a runner
has loaded the kernels the cache owns a C++ `HierKV` over its buffers (`native`,
`kernels/cpu/kv_cache.py`): the one writer of a forward's K/V into F2 and the fused attention,
for `attend` and the C++ stack's step (`native_step`) alike. Otherwise it writes in PyTorch
and attends through `kernels.attention.hier_attention` over the layer's `HierLayerView` (the
device's fused kernel, or with `fused = False` the PyTorch reference); the same data either way.

Rollback is `truncate`, which only shortens the full-precision region. `commit(n)` marks
positions < n as confirmed by the target; only confirmed KV is ever quantized, and the cache
enforces it: a write that needs room rotates F1 into the planes (one whole K group, about once
per G confirmed tokens) and raises `CommitInvariantError` if F1 holds unconfirmed tokens.

A token at position p always sees history quantized up to max(0, (p // G - 1) * G) and the
rest in full precision, however the tokens were fed (`_boundary`): AR decoding, G-aligned
chunked prefill and speculative rounds with rejections give identical KV, which is what makes
greedy QuantSpec token-for-token equal to autoregressive decoding on the target path. F1 is
rotated into the planes lazily, once the committed length shows that no future query needs
it in full precision; queries past that point before the rotation (draft steps, the later
tokens of a verify) see F1 quantized: it is staged once into the planes' next slot, which
the rotation later fills with the very same values. The full-precision buffer therefore holds
2G tokens plus up to G of slack for a round's unverified tokens.

Sliding-window layers (Gemma 2/3's local layers, Mistral's and Phi-3's every layer, Qwen's
from `max_window_layers` on) keep their planes in a second stack, `local_*`, of a window's
worth of positions: a local layer's planes begin at `base[layer]` (a multiple of G), and the
groups no later query can see (every query sits at or past n_quant, and sees the positions >
p - window) are dropped as new ones come (`_fit`), so its memory is O(window), not
O(context). The C++ attention reads absolute positions from that base (the bits do not
depend on it); the other attentions get the layer's view with positions counted from it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kernels.attention import hier_attention
from kernels.cpu import kv_cache as cpu_kv
from kernels.cpu.dequant import dequantize_into
from kernels.formats import QUERY_MAX_DIM
from kernels.planes import (
    VIEWS,
    HierLayerView,
    QuantizedGroupTensor,
    QueryRows,
    quantize_keys,
    quantize_values,
)
from kernels.triton.kv_pack import quantize_keys_triton, quantize_values_triton
from qspec_core.cache.hier_planes import (  # noqa: F401 (K_GROUPED, PLANE_BUFFERS: tests')
    K_GROUPED,
    LOCAL,
    PLANE_BUFFERS,
    PlaneStacks,
    local_slots,
)
from qspec_core.cache.protocol import layer_stacks, write_kv
from qspec_core.config import ModelConfig
from qspec_core.precision import Precision


def kv_view(path: Precision) -> str:
    """The KV view ("int8" or "int4") a path reads from this cache; ValueError for others."""
    kv = getattr(path, "kv", None)
    if kv not in VIEWS:
        raise ValueError(f"the hierarchical cache serves the KV views {VIEWS}, not {path!r}")
    return kv


class CommitInvariantError(RuntimeError):
    """Quantizing would take in KV that the target path has not confirmed."""


class HierarchicalKVCache(PlaneStacks, torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_seq_len: int,
        group_size: int | None = None,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        chunk_size: int | None = None,
        rope_capacity: int | None = None,
    ):
        super().__init__()
        D = config.head_dim
        G = group_size or D
        if D % 2 or D % G:
            raise ValueError(f"group size {G} must divide head_dim {D} (an even number)")
        self.group_size = G
        self.chunk_size = chunk_size or 8 * G  # flash-decoding chunk of quantized history
        if self.chunk_size % G:
            raise ValueError("chunk_size must be a multiple of the group size")
        self.max_seq_len = max_seq_len
        self.rope_capacity = rope_capacity or max_seq_len  # (KVCache; a snapshot keeps it)
        self.softcap = config.attn_logit_softcapping  # (Gemma 2's; None: none)
        self.windows = config.windows  # per layer, its sliding window (None: global)
        L, B, n_kv = config.num_hidden_layers, batch_size, config.num_key_value_heads
        S = -(-max_seq_len // G) * G  # quantized capacity, whole groups
        # each layer's stack (global, or local: `LOCAL`) and its index there
        self._local, self._slot = layer_stacks(self.windows)
        self.window = max((w for w in self.windows if w is not None), default=None)
        n_local = self._local.count(True)
        self.base = [0] * L  # per layer: the position its planes begin at (0 unless local)

        def buf(name, shape, dt):
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), False)

        def planes(prefix: str, layers: int, S: int):
            shape = (layers, B, n_kv, S, D // 2)  # [L, B, n_kv, S, D/2] uint8, two nibbles a byte
            for name in ("k_upper", "k_lower", "v_upper", "v_lower"):
                buf(prefix + name, shape, torch.uint8)
            k_meta = (layers, B, n_kv, S // G, D)  # K: per channel per G tokens
            buf(prefix + "k_scale", k_meta, torch.float32)
            buf(prefix + "k_zero", k_meta, torch.float32)
            v_meta = (layers, B, n_kv, S, D // G)  # V: per token per G channels
            buf(prefix + "v_scale", v_meta, torch.float32)
            buf(prefix + "v_zero", v_meta, torch.float32)

        planes("", L - n_local, S)
        if n_local:  # (only a model with sliding windows has the local stack)
            planes(LOCAL, n_local, min(S, local_slots(self.window, G)))
        # [F1 | F2] plus G of slack, so that a verify forward crossing a group boundary never
        # forces a rotation in the middle of its tokens (see `_boundary`).
        buf("fp_k", (L, B, n_kv, 3 * G, D), dtype)
        buf("fp_v", (L, B, n_kv, 3 * G, D), dtype)
        # Per-layer lengths: equal between forwards; a forward interrupted half-way leaves
        # the early layers ahead, which stays correct (each layer's data is self-consistent).
        self.n_quant = [0] * L
        self.fp_len = [0] * L
        self.committed = 0
        self.rotate_seconds = 0.0  # time spent quantizing F1 (for the stage breakdown)
        self._staged = [-1] * L  # per layer: n_quant whose F1 sits quantized in the next slot
        self.fused = None  # None: the fused kernel when one runs here; False: the reference
        # Per-forward memo: every layer of a forward gets the same input_pos tensor, so its
        # host read and the per-query index tensors are made once, not once per layer.
        self._pos_memo: tuple | None = None
        self._rows_memo: tuple | None = None
        self._parents: torch.Tensor | None = None  # a tree forward's (`tree_rows`), else None
        self._native = cpu_kv.NativeMemo()  # the C++ `HierKV` over the buffers

    # ------------------------------------------------------------------ lengths and protocol
    @property
    def seq_len(self) -> int:
        return self.n_quant[-1] + self.fp_len[-1]

    @property
    def quantized_len(self) -> int:
        return min(self.n_quant)

    @property
    def rewind_floor(self) -> int:
        """The shortest length `truncate` goes back to: the positions below are quantized."""
        return max(self.n_quant)

    def commit(self, length: int) -> None:
        """Positions < length are confirmed by the target path (may now be quantized)."""
        if length > self.seq_len:
            raise ValueError(f"cannot commit {length} positions of a cache of {self.seq_len}")
        self.committed = max(self.committed, length)

    def truncate(self, length: int) -> None:
        """Roll back to `length` positions; only the full-precision region can shrink."""
        if length > self.seq_len:
            raise ValueError(f"cannot truncate a cache of length {self.seq_len} to {length}")
        if length < max(self.n_quant):
            raise ValueError(
                f"cannot roll back to {length}: positions < {max(self.n_quant)} are quantized"
            )
        for layer in range(len(self.fp_len)):
            self.fp_len[layer] = length - self.n_quant[layer]
        self.committed = min(self.committed, length)

    def grow(self, max_seq_len: int) -> None:
        """Reallocate the planes and their scales to hold `max_seq_len` positions, keeping
        every position and the staged slot; the full-precision region keeps its size. A
        session sizes its cache to what it needs now and grows it (`ChatSession`): a
        preallocated context of 128k positions would be 8.6 GB for an 8B model. The C++
        `HierKV` is made again over the new buffers (`NativeMemo` sees them replaced)."""
        if max_seq_len <= self.max_seq_len:
            return
        G = self.group_size
        S = -(-max_seq_len // G) * G
        self._resize("", S)
        if self.window is not None:  # (a local stack capped by a short context grows too)
            want = min(S, local_slots(self.window, G))
            if want > self.local_k_upper.shape[3]:
                self._resize(LOCAL, want)
        self.max_seq_len = max_seq_len

    def reset(self) -> None:
        self.n_quant = [0] * len(self.n_quant)
        self.fp_len = [0] * len(self.fp_len)
        self.base = [0] * len(self.base)
        self.committed = 0
        self._staged = [-1] * len(self._staged)

    @contextmanager
    def tree_rows(self, parents: Sequence[int]) -> Iterator[None]:
        """The forwards inside are a token tree's verify (`kernels.planes.QueryRows`): row t
        of T goes to slot start + t (start = its first position), at the position its depth
        gives, and sees the committed keys and its ancestors' only. parents [T]: each row's
        parent row (earlier), -1 for a root (row 0 is one). Then `keep_rows` moves the
        accepted path's K/V into place."""
        parents = torch.as_tensor(parents, dtype=torch.int64).reshape(-1)
        if parents.numel() and int(parents[0]) != -1:
            raise ValueError("a tree's first row is a root (parents[0] = -1)")
        self._parents, self._pos_memo, self._rows_memo = parents, None, None
        try:
            yield
        finally:
            self._parents, self._pos_memo, self._rows_memo = None, None, None

    @property
    def verifies_trees(self) -> bool:
        """Whether a tree's verify here gives each row its chain's bits: where the C++
        attention runs (`native`, not the reference); the Triton kernel reads chains only."""
        return self.native is not None and self.fused is not False

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """After a tree forward from `start`: the K/V of its rows `rows` (a path from the
        root, increasing) move to slots start, start + 1, ... in every layer, where a chain's
        would be; then truncate to start + len(rows) to drop the rest."""
        rows = [int(r) for r in rows]
        if any(b <= a for a, b in zip(rows, rows[1:], strict=False)) or (rows and rows[0] < 0):
            raise ValueError(f"rows {rows} are not increasing")
        end = start + len(rows)
        if rows and start + rows[-1] >= self.seq_len:
            raise ValueError(f"row {rows[-1]} from {start} is past the cache ({self.seq_len})")
        moved = [(i, r) for i, r in enumerate(rows) if r != i]
        if moved:
            dst = torch.tensor([i for i, _ in moved])
            src = torch.tensor([r for _, r in moved])
            for layer in range(len(self.n_quant)):
                lo = start - self.n_quant[layer]
                if lo < 0:
                    raise ValueError(f"cannot move rows below {self.n_quant[layer]}: quantized")
                if lo < self.group_size:
                    self._staged[layer] = -1  # (F1's slots change: its staged copy is stale)
                for fp in (self.fp_k, self.fp_v):
                    fp[layer, :, :, lo + dst] = fp[layer, :, :, lo + src]
        self.truncate(end)

    # ------------------------------------------------------------------ writes
    def _rotate(self, layer: int) -> None:
        """Quantize F1 (G confirmed tokens, one whole K group) and slide F2 down into F1."""
        t0 = time.perf_counter()
        G, nq = self.group_size, self.n_quant[layer]
        if nq + G > self.committed:
            raise CommitInvariantError(
                f"rotation would quantize positions {nq}..{nq + G - 1}, but only positions "
                f"< {self.committed} are confirmed by the target path"
            )
        if self._staged[layer] != nq:  # (a fused attention may have quantized F1 already)
            self._stage_f1(layer)
        rest = self.fp_len[layer] - G
        for fp in (self.fp_k, self.fp_v):
            fp[layer, :, :, :rest] = fp[layer, :, :, G : G + rest].clone()
        self.n_quant[layer] = nq + G
        self.fp_len[layer] = rest
        self._staged[layer] = -1
        self.rotate_seconds += time.perf_counter() - t0

    def _boundary(self, positions: torch.Tensor) -> torch.Tensor:
        """Where quantized history ends for a token at each position: max(0, (p // G - 1) G).

        A function of the position alone, so every way of feeding the same tokens (one by one,
        G-aligned chunks, draft steps then a verify that crosses a group boundary) gives every
        token exactly the same KV view. At least G and fewer than 2G recent tokens stay full
        precision for each query.
        """
        G = self.group_size
        return ((positions // G - 1) * G).clamp(min=0)

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor, lo: int) -> None:
        """Writes a forward's k/v [B, n_kv, T, D] at [lo, lo + T) of a layer's full-precision
        region (claimed by `_claim`): through the C++ `HierKV` where there is one, so the
        region has one writer per cache (`write_kv`)."""
        write_kv(self.native, self.fp_k, self.fp_v, layer, k, v, lo)

    def _claim(self, layer: int, start: int, end: int) -> tuple[int, int]:
        """Make room for positions [start, end) in a layer's full-precision region (rotating
        if due) and count them in; returns where they go in it, [lo, hi)."""
        G = self.group_size
        if start < self.n_quant[layer]:
            raise ValueError(
                f"cannot write position {start}: positions < {self.n_quant[layer]} are quantized"
            )
        if start > self.n_quant[layer] + self.fp_len[layer]:
            raise ValueError(
                f"write at {start} leaves a gap after {self.n_quant[layer] + self.fp_len[layer]}"
            )
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} is beyond the cache ({self.max_seq_len})")
        if start < self.n_quant[layer] + G:
            self._staged[layer] = -1  # F1 is being rewritten: its staged quantization is stale
        self.fp_len[layer] = start - self.n_quant[layer]  # a write below the end rolls back
        # Rotate (lazily) once no future query needs F1 in full precision. Queries come from
        # positions >= the committed length (everything later may still be rewritten), so
        # the committed length decides, never a draft position: then every query sees at
        # least as much history quantized as is stored, and `attend` quantizes F1 on the
        # fly for those that see more. Only committed KV can be rotated, by construction.
        while max(0, (self.committed // G - 1) * G) >= self.n_quant[layer] + G:  # _boundary
            self._rotate(layer)
        lo, hi = start - self.n_quant[layer], end - self.n_quant[layer]
        if hi > 3 * G:
            raise ValueError(
                f"a forward of {end - start} tokens does not fit the "
                f"full-precision buffer; feed at most G = {G} tokens at a time"
            )
        self.fp_len[layer] = hi
        return lo, hi

    @property
    def native(self):
        """The C++ `HierKV` over this cache's buffers (`kernels/cpu/kv_cache.py`), made when
        the buffers are first used and again when one is replaced (`.to()`, a cast); None off
        the CPU, for a region not fp32, or before a runner has loaded the kernels."""
        buffers = tuple(self._buffers[name] for name in cpu_kv.HIER_BUFFERS)
        if not cpu_kv.usable(*buffers):
            return None
        named = dict(zip(cpu_kv.HIER_BUFFERS, buffers, strict=True))
        local = ()
        if self.window is not None:  # the local stack, in the same order (its fp: unused)
            local = tuple(self._buffers[LOCAL + name] for name in cpu_kv.HIER_BUFFERS[:8])
        G, chunk = self.group_size, self.chunk_size

        def make():
            return cpu_kv.hier_kv(named, G, chunk, self.windows, local, self._slot)

        return self._native.get(buffers + local, make)

    def native_step(self, input_pos: torch.Tensor, path: Precision, n_tokens: int):
        """For a forward of `native`'s C++ stack: does every layer's bookkeeping of `attend`
        now and returns the `HierStep` (`kernels/cpu/kv_cache.h`) the stack's layers write and
        attend with; None when this forward must go layer by layer (no `native`, the reference
        attention asked for, layers out of step, a forward longer than G, a bad path:
        `attend` raises)."""
        kv = getattr(path, "kv", None)
        L, G = len(self.n_quant), self.group_size
        if (
            kv not in VIEWS
            or n_tokens > G  # (then a late query could need an F1 this forward rewrites)
            or self.fused is False
            or self.n_quant.count(self.n_quant[0]) != L
            or self.fp_len.count(self.fp_len[0]) != L
            or len(self._local_bases()) > 1
            or self.native is None
        ):
            return None
        start, end = self._span(input_pos)
        for layer in range(L):
            lo, hi = self._claim(layer, start, end)
        nq = self.n_quant[0]
        any_late, n_quant_q, shift = self._query_rows(input_pos, start, end, nq)
        if any_late:  # late queries read F1 quantized from the planes' next slot
            for layer in range(L):
                if self._staged[layer] != nq:
                    self._stage_f1(layer)
        iq = self._int_queries(path, q_device=self.fp_k.device)
        local_base = max(self.base)  # (the local layers', in step; 0 for the global ones)
        return self._step(lo, hi, nq, n_quant_q, shift, input_pos, kv, iq, local_base)

    def _step(
        self, lo, hi, nq, n_quant_q, shift, input_pos, kv: str, int_queries: bool, local_base=0
    ):
        """The `HierStep` of a forward whose tokens sit at [lo, hi) of the region; the
        local layers' planes begin at `local_base`."""
        return cpu_kv.hier_step(
            lo=lo,
            n_fp=hi,
            n_quant=nq,
            n_quant_q=n_quant_q,
            shift=shift,
            input_pos=input_pos,
            int8=kv == "int8",  # (the target's view: both planes)
            int_queries=int_queries,
            softcap=float(self.softcap or 0.0),
            parents=self._parents,
            local_base=local_base,
        )

    def attend(self, layer, q, k, v, input_pos, path: Precision):
        """Store k/v [B, n_kv, T, D] at input_pos [T] in F2; attend q [B, H, T, D] in the KV
        view `path.kv` ("int8" or "int4")."""
        kv = kv_view(path)
        start, end = self._span(input_pos)
        lo, hi = self._claim(layer, start, end)
        self._put(layer, k, v, lo)
        # Late queries read F1 quantized from the planes' next slot, staged there once (the
        # rotation later writes the very same values), and skip it in the fp region.
        nq = self.n_quant[layer]
        any_late, n_quant_q, shift = self._query_rows(input_pos, start, end, nq)
        if any_late and self._staged[layer] != nq:
            self._stage_f1(layer)
        fused = self.fused is not False
        iq = self._int_queries(path, q.device)
        native = self.native
        base = self.base[layer]
        if native is not None and fused:  # (the C++ kernel, as in the stack's step)
            step = self._step(lo, hi, nq, n_quant_q, shift, input_pos, kv, iq, base)
            return native.attend(layer, q, step).to(q.dtype)
        if base:  # (the view counts positions from the layer's base)
            n_quant_q, input_pos = n_quant_q - base, input_pos - base
        rows = QueryRows(n_quant_q, shift, input_pos, self._parents, self.windows[layer])
        chunk = self.chunk_size if q.device.type == "cpu" else None  # Triton: fill the GPU
        return hier_attention(q, self.layer_view(layer), rows, kv, chunk, fused, iq, self.softcap)

    def _int_queries(self, path: Precision, q_device: torch.device) -> bool:
        """Whether `path` rounds its queries to int16 here: on a CPU only (not the GPU's
        draft), and for head dims whose integer dots fit int32 (`kernels.formats`)."""
        head_dim = self.fp_k.shape[-1]
        return path.int_queries and q_device.type == "cpu" and head_dim <= QUERY_MAX_DIM

    def layer_view(self, layer: int) -> HierLayerView:
        """One layer's planes, metadata and full-precision region, as the attention reads it,
        positions counted from the layer's `base` (0 but for a local layer's dropped groups)."""
        n_fp = self.fp_len[layer]
        return HierLayerView(
            **{name: self._plane(name, layer) for name in PLANE_BUFFERS},
            fp_k=self.fp_k[layer, :, :, :n_fp],
            fp_v=self.fp_v[layer, :, :, :n_fp],
            fp_pos0=self.n_quant[layer] - self.base[layer],
            group_size=self.group_size,
        )

    def _span(self, input_pos: torch.Tensor) -> tuple[int, int]:
        """The slots [first, first + T) a forward of input_pos [T] writes (a chain's positions;
        a tree's rows, `tree_rows`), read from it once per forward."""
        memo = self._pos_memo
        if memo is None or memo[0] is not input_pos:
            first = int(input_pos[0])
            memo = self._pos_memo = (input_pos, (first, first + input_pos.numel()))  # (alive)
        return memo[1]

    def _query_rows(self, input_pos: torch.Tensor, start: int, end: int, nq: int):
        """For the queries of a forward writing slots [start, end) over a layer with nq
        quantized positions: (any late query, n_quant per query [T], shift per query [T]);
        late queries see F1 as history (`_boundary(p) > nq`, p a query's position: a tree
        row's is its depth's), which the kernel reads from the planes' next slot."""
        tree = self._parents is not None  # (its positions: fixed while `tree_rows` holds it)
        key = (start, end, nq, id(self._parents) if tree else None)
        if self._rows_memo is None or self._rows_memo[0] != key:
            G = self.group_size
            positions = input_pos.tolist() if tree else range(start, end)
            late = [max(0, (p // G - 1) * G) > nq for p in positions]  # _boundary
            shift = torch.tensor([G if x else 0 for x in late], dtype=torch.int64)
            self._rows_memo = (key, (any(late), nq + shift, shift))
        return self._rows_memo[1]

    def _stage_f1(self, layer: int) -> None:
        """Quantize F1 (confirmed, one whole K group) into the planes at [nq, nq + G)."""
        G, nq = self.group_size, self.n_quant[layer]
        self._fit(layer, nq + G)
        k, v = self.fp_k[layer, :, :, :G], self.fp_v[layer, :, :, :G]
        if k.is_cuda:  # planes [B, n_kv, G, D/2]
            k, v = quantize_keys_triton(k, G), quantize_values_triton(v, G)
        else:  # (the twins, bit for bit: on a CPU the interpreter, a test tool, ran them
            k, v = quantize_keys(k, G), quantize_values(v, G)  # 100x slower; tests compare)
        self._write_planes(layer, nq - self.base[layer], k, v)
        self._staged[layer] = nq

    def _write_planes(self, layer: int, at: int, k, v) -> None:
        """Quantized keys and values (`QuantizedGroupTensor`s of n positions, whole K groups)
        into a layer's planes from slot `at` (a multiple of G)."""
        G, n = self.group_size, k.upper.shape[2]
        for name, t, slots in (
            ("k_upper", k.upper, (at, at + n)),
            ("k_lower", k.lower, (at, at + n)),
            ("k_scale", k.scale, (at // G, (at + n) // G)),
            ("k_zero", k.zero, (at // G, (at + n) // G)),
            ("v_upper", v.upper, (at, at + n)),
            ("v_lower", v.lower, (at, at + n)),
            ("v_scale", v.scale, (at, at + n)),
            ("v_zero", v.zero, (at, at + n)),
        ):
            self._plane(name, layer)[:, :, slots[0] : slots[1]] = t

    def load_full_precision(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Bulk load of a prompt's full-precision KV: k/v [L, B, n_kv, T, D], all confirmed,
        replacing what the cache held. Quantizes all but the last G..2G tokens (all of them
        stay full precision if T < 2G), as a chunked prefill (`cache/prefill.py`) leaves it."""
        T, G = k.shape[3], self.group_size
        if T > self.max_seq_len:
            raise ValueError(f"{T} positions exceed the cache ({self.max_seq_len})")
        nq = max(0, (T // G - 1) * G)
        self.reset()
        for layer in range(k.shape[0]):
            self.append_quantized(layer, k[layer, :, :, :nq], v[layer, :, :, :nq])
            self.set_recent(layer, k[layer, :, :, nq:], v[layer, :, :, nq:])
        self.committed = T

    def append_quantized(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize a prompt's k/v [B, n_kv, n, D] (n whole groups of G, confirmed: the caller
        vouches) into a layer's planes right after its quantized history; the layer's
        full-precision region must be empty (a prefill's bookkeeping, not a decode's)."""
        G, nq, n = self.group_size, self.n_quant[layer], k.shape[2]
        if n % G or self.fp_len[layer]:
            raise ValueError("whole groups of G tokens, onto an empty full-precision region")
        self._fit(layer, nq + n)
        if n:
            kq, vq = quantize_keys(k, G), quantize_values(v, G)
            self._write_planes(layer, nq - self.base[layer], kq, vq)
        self.n_quant[layer] = nq + n
        self._staged[layer] = -1

    def set_recent(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A layer's full-precision region becomes k/v [B, n_kv, n, D] (n <= 2G: a prompt's
        last tokens after its quantized history)."""
        n = k.shape[2]
        if n > 2 * self.group_size:
            raise ValueError(f"{n} recent tokens overflow the full-precision region")
        if self.n_quant[layer] + n > self.max_seq_len:
            raise ValueError(f"the cache holds at most {self.max_seq_len} positions")
        self.fp_k[layer, :, :, :n] = k
        self.fp_v[layer, :, :, :n] = v
        self.fp_len[layer] = n
        self._staged[layer] = -1

    def dequantize_into(
        self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor, view: str = "int8", first=0
    ) -> None:
        """A layer's quantized history from position `first` (a multiple of G) in `view` into
        k_out/v_out [B, n_kv, n_quant - first, D] fp32 (rows contiguous): `kernels/cpu/
        dequant.py`, the reference's numbers."""
        G, base = self.group_size, self.base[layer]
        nq = self.n_quant[layer] - base
        first -= base  # (slots)
        assert first % G == 0 and 0 <= first <= nq, (first, G, nq)  # (the prefill's own bound)
        planes = {name: self._plane(name, layer) for name in PLANE_BUFFERS}
        keys = QuantizedGroupTensor(
            planes["k_upper"][:, :, first:nq],
            planes["k_lower"][:, :, first:nq],
            planes["k_scale"][:, :, first // G : nq // G],
            planes["k_zero"][:, :, first // G : nq // G],
        )
        values = QuantizedGroupTensor(
            planes["v_upper"][:, :, first:nq],
            planes["v_lower"][:, :, first:nq],
            planes["v_scale"][:, :, first:nq],
            planes["v_zero"][:, :, first:nq],
        )
        dequantize_into(keys, G, True, view, k_out)
        dequantize_into(values, G, False, view, v_out)
