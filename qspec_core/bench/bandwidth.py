"""How far each decode step is from the memory-bandwidth limit, measured in the bench's run.

A decode step of a small model reads every weight of its path once and the KV history of its
view once; at long context it can do no better than (those bytes) / (the machine's read
bandwidth). The bench measures that bandwidth in the same process and threads, right before
its runs (`read_bandwidth`: a STREAM-like read of a buffer far larger than any cache), and
reports per step kind (an autoregressive step, a draft step, a verify) the bytes it must read,
its measured time, and bytes / time as a fraction of the probe. A fraction near 1 means the
step is as fast as memory allows; far below, the step is compute- or overhead-bound.

Bytes per step (`path_weight_bytes` + context x KV bytes per history token): every linear's
weights in the path's weight set (full: the model's dtype, or bf16 where the runner reads bf16
copies of bf16-valued fp32 weights, `runner/layouts.py`; int8 and w8a8: the INT8 twins
with their scales; int4: the 4-bit twins with scales and zero points, the full weight where a
layer has none), lm_head included (a draft step: only its sliced vocabulary's rows), norms
and the embedding row left out (under 0.1%). A verify of gamma + 1 tokens reads them once, as
a single step does.
"""

from __future__ import annotations

import time

import torch

from qspec_core.model.transformer import Transformer, linear_layers

PROBE_MIB = 512  # far past the last-level cache of any CPU we run on
PROBE_REPEATS = 5


def probe_buffer(mib: int = PROBE_MIB) -> torch.Tensor:
    """A `mib` MiB fp32 buffer for `read_bandwidth`, written once (its pages exist)."""
    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    return buf


def read_bandwidth(
    mib: int = PROBE_MIB, repeats: int = PROBE_REPEATS, buf: torch.Tensor | None = None
) -> float:
    """The best of `repeats` timed reads of a `mib` MiB fp32 buffer (or of `buf`, a
    `probe_buffer` kept between probes) on torch's current CPU threads, in bytes/s (a
    reduction: each byte read once, nothing written back)."""
    buf = probe_buffer(mib) if buf is None else buf
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * buf.element_size() / best


def _nbytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def path_weight_bytes(
    model: Transformer, weights: str, layouts=None, head_rows: int | None = None
) -> int:
    """Weight bytes a step on `weights` reads: each linear's twin for that set (see above);
    `layouts`: the runner's `WeightLayouts`, whose bf16 copies its steps read instead of the
    layers' own fp32 weights (None: no copies); `head_rows`: the rows of lm_head the step
    reads (a draft's sliced vocabulary, `engine/draft_vocab.head_rows`; None: all)."""
    total = 0
    for layer in linear_layers(model).values():
        twin = layer.twin(weights)
        if twin is not None:
            nbytes = _nbytes(twin)
        else:
            copy = layouts.bf16(layer) if layouts is not None else None
            nbytes = _nbytes(layer) - (0 if copy is None else layer.weight.nbytes - copy.nbytes)
        if layer is model.lm_head and head_rows is not None:
            nbytes = nbytes * head_rows // layer.out_features  # (rows and their scales)
        total += nbytes
    return total


def kv_read_positions(history: float, windows: tuple[int | None, ...]) -> float:
    """History positions a step reads per layer, on average over the layers: all `history` of
    a global layer's, at most its `window` of a local one's (`ModelConfig.windows`). Times the
    KV bytes per history token of all layers, the KV bytes a step reads."""
    return sum(history if w is None else min(history, w) for w in windows) / len(windows)


def step_traffic(
    seconds: float, steps: int, weight_bytes: int, kv_bytes: float, bandwidth: float
) -> dict:
    """One step kind's line: ms per step, MB read per step, and the fraction of `bandwidth`."""
    ms = 1000 * seconds / steps if steps else 0.0
    nbytes = weight_bytes + kv_bytes
    return {
        "steps": steps,
        "ms": round(ms, 4),
        "mb_read": round(nbytes / 1e6, 3),
        "fraction_of_bandwidth": round(nbytes / (ms / 1000) / bandwidth, 4) if ms else None,
    }
