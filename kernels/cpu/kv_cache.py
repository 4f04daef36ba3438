"""The caches' C++ objects (`kv_cache.h` / `kv_cache.cpp`): what crosses the line between a
KV cache (`qspec_core/cache/`) and the CPU kernels, every field by name.

- `HierKV` over the hierarchical cache's buffers (all layers), `FullKV` over the
  full-precision cache's k/v: made and owned by the cache, over its own buffers (no copy);
  `write(layer, k, v, lo)` puts a forward's new K/V into them (the one place that does, for
  the cache's per-layer `attend` and for `DecoderStack` alike) and `attend(layer, q, step)`
  runs the attention over them.
- `HierStep` / `FullStep`: one forward's positions and view, which the cache fills once for
  every layer.

`DecoderStack.run(x, cos, sin, cache, step)` takes an object and its step. None of these exist
until a CPU runner has loaded the kernels (`kernels.cpu.build.loaded()`), nor where they cannot
be built: the caches then write in PyTorch and attend through `kernels.attention`.
"""

from __future__ import annotations

import torch

from kernels.cpu import build as cpu_ext

HIER_BUFFERS = (
    "k_upper",
    "k_lower",
    "k_scale",
    "k_zero",
    "v_upper",
    "v_lower",
    "v_scale",
    "v_zero",
    "fp_k",
    "fp_v",
)  # the hierarchical cache's buffers, by the names `HierKV` takes


def usable(*buffers: torch.Tensor) -> bool:
    """Whether a cache with these buffers gets a C++ object: fp32 full-precision data on a
    CPU, with the kernels loaded in this process (a CPU runner loads them; a cache never
    starts a build by itself, so a model run without a runner stays plain PyTorch)."""
    fp = buffers[-1]
    return fp.dtype == torch.float32 and fp.device.type == "cpu" and cpu_ext.loaded() is not None


class NativeMemo:
    """A cache's C++ object, kept with the buffers it was made over: `get` makes it again when
    one of them is replaced (`.to()`, a cast, `grow`: an identity check per call). A copy of
    the cache starts without one (a C++ object cannot be copied; it is made again over the
    copy's buffers)."""

    def __init__(self):
        self._memo: tuple | None = None  # (the buffers, the object over them)

    def get(self, buffers: tuple, make):
        memo = self._memo
        if memo is None or any(a is not b for a, b in zip(memo[0], buffers, strict=True)):
            memo = self._memo = (buffers, make())
        return memo[1]

    def __deepcopy__(self, memo) -> NativeMemo:
        return NativeMemo()

    def __getstate__(self) -> dict:
        return {"_memo": None}


def hier_kv(
    buffers: dict[str, torch.Tensor],
    group_size: int,
    chunk: int,
    windows: tuple = (),
    local: tuple = (),
    slots: tuple = (),
):
    """A `HierKV` over `buffers` (the `HIER_BUFFERS`, [L, ...] each; fp_k/fp_v fp32), each
    layer attending within its sliding window (`windows` [L]: None or 0 a global layer; empty:
    every layer global). `local`: the sliding-window layers' own planes (the first 8
    `HIER_BUFFERS`, [Ll, ...] each; `HierStep.local_base` says where they begin), `buffers`
    then holding the global layers'; `slots` [L]: each layer's index in its stack."""
    windows = [int(w or 0) for w in windows]
    return cpu_ext.load().HierKV(
        **buffers,
        group_size=group_size,
        chunk=chunk,
        windows=windows,
        local=list(local),
        slots=[int(s) for s in slots],
    )


def hier_step(**fields):
    """A `HierStep`: lo, n_fp, n_quant, n_quant_q, shift, input_pos, int8, int_queries,
    softcap, parents, local_base."""
    return cpu_ext.load().HierStep(**fields)


def full_kv(
    k: torch.Tensor, v: torch.Tensor, windows=(), softcap: float | None = None, local=(), slots=()
):
    """A `FullKV` over k/v [L, B, n_kv, S, D] fp32: each layer's sliding window (None or 0:
    global; () all global) and Gemma 2's soft cap (None: none). `local`: the sliding-window
    layers' own (k, v), [Ll, B, n_kv, Sw, D] each (`FullStep.local_base` says where they
    begin), k/v then holding the global layers'; `slots` [L]: each layer's index in its stack."""
    windows = [int(w or 0) for w in windows]
    local_k, local_v = local or (None, None)
    return cpu_ext.load().FullKV(
        k=k,
        v=v,
        windows=windows,
        softcap=float(softcap or 0.0),
        local_k=local_k,
        local_v=local_v,
        slots=[int(s) for s in slots],
    )


def full_step(**fields):
    """A `FullStep`: start, end (positions [start, end)), SDPA's mask or is_causal; a local
    layer's keys from local_start (-1, the default: none hidden) under local_mask, its stack's
    slot 0 holding position local_base."""
    return cpu_ext.load().FullStep(**fields)
