"""Where a hierarchical cache's planes live (`HierarchicalKVCache`'s storage half): the global
layers' stack and the sliding-window layers' (`LOCAL`), a local layer's drops of the groups no
later query sees (`_fit`), and the state a checkpoint or a snapshot holds and loads back.

A local layer's slot i holds position base[layer] + i (its K scales and zeros: group i from
base / G on); a global layer's base is 0. See `cache/hierarchical.py` for the rest.
"""

from __future__ import annotations

import torch

from kernels.planes import kv_bytes_per_token
from qspec_core.cache.protocol import CacheCheckpoint

# the buffers that grow with the context (dim 3); the full-precision region does not
PLANE_BUFFERS = ("k_upper", "k_lower", "v_upper", "v_lower")  # positions along dim 3
PLANE_BUFFERS += ("k_scale", "k_zero", "v_scale", "v_zero")  # (K's: groups along dim 3)
K_GROUPED = ("k_scale", "k_zero")  # one entry per G positions
LOCAL = "local_"  # the local (sliding-window) layers' stack: "local_k_upper", ...


def local_slots(window: int, group_size: int) -> int:
    """Positions a local layer's planes hold: the window's groups, the group its oldest key
    straddles, the staged F1 and one more group, so that each drop frees at least a group
    (a drop copies the kept groups down: about window / G positions a token, beside the
    window the attention reads for it)."""
    G = group_size
    return -(-window // G) * G + 3 * G


class PlaneStacks:
    """The storage methods of `HierarchicalKVCache` (a mixin: the buffers, lengths and bases
    are the cache's own)."""

    def _resize(self, prefix: str, S: int) -> None:
        """A stack's planes and scales reallocated to hold S positions (a multiple of G),
        keeping the first S positions they hold."""
        G = self.group_size
        for name in PLANE_BUFFERS:  # dim 3: positions, or K groups (k_scale, k_zero)
            old = getattr(self, prefix + name)
            n = S // G if name in K_GROUPED else S
            # (a prefill under inference mode grows a local stack: its buffers must stay
            # writable after it)
            with torch.inference_mode(False):
                new = old.new_zeros(*old.shape[:3], n, old.shape[4])
                keep = min(n, old.shape[3])
                new[:, :, :, :keep] = old[:, :, :, :keep]
            setattr(self, prefix + name, new)  # (replaces the registered buffer)

    def _plane(self, name: str, layer: int) -> torch.Tensor:
        """A layer's `name` buffer in its stack, [B, n_kv, capacity, ...]: slot i holds
        position base[layer] + i (K scales and zeros: group i, from base / G on)."""
        return getattr(self, LOCAL + name if self._local[layer] else name)[self._slot[layer]]

    def _local_bases(self) -> set[int]:
        """The local layers' bases (one, unless a forward was interrupted half-way)."""
        return {base for base, is_local in zip(self.base, self._local, strict=True) if is_local}

    def _keep_from(self, layer: int) -> int:
        """The first position a local layer must keep: the group holding the oldest key that
        a query at or past its quantized length can see (global layers: 0)."""
        if not self._local[layer]:
            return 0
        G, window = self.group_size, self.windows[layer]
        return max(self.base[layer], max(0, self.n_quant[layer] - window + 1) // G * G)

    def _fit(self, layer: int, end: int) -> None:
        """Room in a layer's planes for the positions below `end` (a multiple of G): a local
        layer first drops the groups no later query sees (moving the rest down), then grows
        its stack if that is not enough; ValueError past the cache's capacity."""
        G = self.group_size
        if end > -(-self.max_seq_len // G) * G:
            raise ValueError(f"the cache holds at most {self.max_seq_len} positions")
        if not self._local[layer]:
            return
        base, capacity = self.base[layer], self.local_k_upper.shape[3]
        if end - base <= capacity:
            return
        keep = self._keep_from(layer)
        if keep > base:  # slots [keep - base, held) move down to 0
            held = min(capacity, self.n_quant[layer] + G - base)  # (with a staged F1)
            for name in PLANE_BUFFERS:
                g = G if name in K_GROUPED else 1
                t = self._plane(name, layer)
                lo, hi = (keep - base) // g, held // g
                t[:, :, : hi - lo] = t[:, :, lo:hi].clone()
            self.base[layer] = base = keep
        if end - base > capacity:
            self._resize(LOCAL, end - base + local_slots(self.windows[layer], G))

    def checkpoint(self) -> CacheCheckpoint:
        """A way back to this state (layers in step, all committed), e.g. the end of a
        document that later answers push into the quantized planes. Planes below n_quant are
        never rewritten, so only the lengths and the full-precision region (at most 3G
        tokens) are kept."""
        meta = self.meta()
        if meta["committed"] != meta["n_quant"] + meta["fp_len"]:
            raise ValueError("a checkpoint needs every position committed")
        n_fp = meta["fp_len"]
        local = None
        if self.window is not None:  # (a window's worth of planes per local layer)
            local = {k: t.clone() for k, t in self._local_state(meta).items()}
        return CacheCheckpoint(
            meta["n_quant"],
            n_fp,
            self.fp_k[:, :, :, :n_fp].clone(),
            self.fp_v[:, :, :, :n_fp].clone(),
            meta.get("local_base", 0),
            local,
        )

    def restore(self, point: CacheCheckpoint) -> None:
        """Return to `point`'s state exactly; whatever came after it is dropped."""
        n_fp = point.fp_len
        self.fp_k[:, :, :, :n_fp] = point.fp_k
        self.fp_v[:, :, :, :n_fp] = point.fp_v
        self.n_quant = [point.n_quant] * len(self.n_quant)
        self.fp_len = [n_fp] * len(self.fp_len)
        self.committed = point.n_quant + n_fp
        self._staged = [-1] * len(self._staged)  # the next slot holds later data now
        if point.local is not None:  # the local planes as they were (drops moved them since)
            self._load_local(point.local, point.local_base, point.n_quant)

    def _load_local(self, local: dict[str, torch.Tensor], base: int, n_quant: int) -> None:
        """The local stack's planes become `local` (buffers by name, [Ll, B, n_kv, n, ...]:
        positions [base, n_quant)), every local layer beginning at `base`."""
        n = n_quant - base
        if n > self.local_k_upper.shape[3]:
            self._resize(LOCAL, n + local_slots(self.window, self.group_size))
        for name in PLANE_BUFFERS:
            t = local[LOCAL + name]
            getattr(self, LOCAL + name)[:, :, :, : t.shape[3]] = t
        self.base = [base if is_local else 0 for is_local in self._local]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the valid data: packed planes, scales/zeros, full-precision region."""
        G, n_fp = self.group_size, self.fp_len[-1]
        payload = scales = 0
        for prefix, held in self._held():
            per_tok_plane = getattr(self, prefix + "k_upper")[:, :, :, 0].numel()  # L B n_kv D/2
            payload += 4 * per_tok_plane * held  # K and V, upper and lower
            scales += 2 * getattr(self, prefix + "k_scale")[:, :, :, 0].numel() * 4 * (held // G)
            scales += 2 * getattr(self, prefix + "v_scale")[:, :, :, 0].numel() * 4 * held
        fp = 2 * self.fp_k[:, :, :, 0].numel() * self.fp_k.element_size() * n_fp
        return {"payload": payload, "scales": scales, "full_precision": fp}

    def _held(self) -> list[tuple[str, int]]:
        """(stack prefix, positions each of its layers holds in its planes) per stack."""
        nq = self.quantized_len
        held = [("", nq)]
        if self.window is not None:
            held.append((LOCAL, max(0, nq - max(self._local_bases()))))
        return held

    def bytes_per_token(self, view: str) -> float:
        """Bytes the KV view `view` ("int8" or "int4") reads per quantized-history token over
        all layers and KV heads (a local layer's: within its window)."""
        L, B, n_kv = self.fp_k.shape[:3]
        D = self.fp_k.shape[4]
        per_head = kv_bytes_per_token(D, view, self.group_size, self.group_size).total
        return per_head * L * B * n_kv

    def meta(self) -> dict:
        if len(set(self.n_quant)) != 1 or len(set(self.fp_len)) != 1:
            raise RuntimeError("layers are out of step (an interrupted forward); truncate first")
        meta = {
            "group_size": self.group_size,
            "n_quant": self.n_quant[0],
            "fp_len": self.fp_len[0],
            "committed": self.committed,
            "max_seq_len": self.max_seq_len,
            "fp_dtype": str(self.fp_k.dtype).removeprefix("torch."),
        }
        if self.window is not None:  # the local layers' state begins there (in step): the
            # oldest group a later query sees (`_keep_from`), not what the planes still hold
            local = [layer for layer, is_local in enumerate(self._local) if is_local]
            if len({(self.base[layer], self._keep_from(layer)) for layer in local}) != 1:
                raise RuntimeError("local layers are out of step; truncate first")
            meta["local_base"] = self._keep_from(local[0])
        return meta

    def state(self) -> dict[str, torch.Tensor]:
        """The valid part of every buffer (what a snapshot stores): the global layers' planes
        from position 0, the local layers' (`LOCAL`) from `meta()["local_base"]`."""
        meta = self.meta()
        G, nq, n_fp = self.group_size, meta["n_quant"], meta["fp_len"]
        out = {
            name: getattr(self, name)[:, :, :, : nq // G if name in K_GROUPED else nq]
            for name in PLANE_BUFFERS
        }
        out["fp_k"] = self.fp_k[:, :, :, :n_fp]
        out["fp_v"] = self.fp_v[:, :, :, :n_fp]
        out |= self._local_state(meta)
        return {k: t.contiguous() for k, t in out.items()}

    def _local_state(self, meta: dict) -> dict[str, torch.Tensor]:
        """The local stack's valid planes, positions [local_base, n_quant) (none without
        local layers)."""
        if self.window is None:
            return {}
        held_from = self.base[self._local.index(True)]  # (the planes' slot 0; in step)
        G, lo, hi = self.group_size, meta["local_base"] - held_from, meta["n_quant"] - held_from
        out = {}
        for name in PLANE_BUFFERS:
            g = G if name in K_GROUPED else 1
            out[LOCAL + name] = getattr(self, LOCAL + name)[:, :, :, lo // g : hi // g]
        return out

    def load_state(self, state: dict[str, torch.Tensor], meta: dict) -> None:
        """`state()`'s tensors (and `meta`) into this cache. A state with no local stack but
        every layer in the global names (a snapshot from before windowed caches) loads too:
        each local layer keeps the groups its later queries can see."""
        if meta["group_size"] != self.group_size:
            raise ValueError(f"state has group size {meta['group_size']}, cache {self.group_size}")
        G, nq, n_fp = self.group_size, meta["n_quant"], meta["fp_len"]
        if nq + n_fp > self.max_seq_len:
            raise ValueError(f"state holds {nq + n_fp} positions, cache {self.max_seq_len}")
        self.reset()
        self.n_quant = [nq] * len(self.n_quant)
        self.fp_len = [n_fp] * len(self.fp_len)
        self.fp_k[:, :, :, :n_fp] = state["fp_k"]
        self.fp_v[:, :, :, :n_fp] = state["fp_v"]
        if self.window is None or LOCAL + "k_upper" in state:
            for name in PLANE_BUFFERS:
                tensor = state[name]
                getattr(self, name)[:, :, :, : tensor.shape[3]] = tensor
            if self.window is not None:
                self._load_local(state, meta["local_base"], nq)
        else:  # every layer's planes from position 0, in layer order
            local = [layer for layer, is_local in enumerate(self._local) if is_local]
            glob = [layer for layer, is_local in enumerate(self._local) if not is_local]
            base = max(0, nq - self.window + 1) // G * G  # (`_keep_from`)
            stacks = {}
            for name in PLANE_BUFFERS:
                g = G if name in K_GROUPED else 1
                getattr(self, name)[:, :, :, : nq // g] = state[name][glob]
                stacks[LOCAL + name] = state[name][local][:, :, :, base // g : nq // g]
            self._load_local(stacks, base, nq)
        self.committed = meta["committed"]
        self._staged = [-1] * len(self._staged)
