"""How far the prefill is from the compute limit, measured in the bench's run.

A prefill of T tokens is matrix products: every linear layer [T, K] x [K, N] (2 T K N FLOPs)
and causal attention (per layer and query head, Q K^T and P V over the T (T + 1) / 2 pairs a
causal mask keeps: 4 D of them). At long context neither memory nor Python overhead should
bound it, only the CPU's multiply-add rate, so the bench measures that rate in the same
process and threads, right before its runs (`gemm_peaks`: the best of a few timed GEMMs at a
prefill shape, per element type), and reports the prefill's FLOPs / time as a fraction of the
best of them. A fraction near 1 means the prefill is as fast as this CPU's fastest GEMM.

Element types probed: fp32, bf16 (fast only with AVX512-BF16 or AMX: on an AVX2-only EPYC
a bf16 GEMM ran at 0.3 GFLOP/s, so a slow first try stops there) and int8 x int8 -> int32
(`torch._int_mm`, oneDNN: VNNI where the CPU has it; AMX only where oneDNN finds the OS grants
it). fp16 is left out (catastrophically slow on every CPU measured: shared/facts.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from qspec_core.config import ModelConfig
from qspec_core.engine.generate import PREFILL_CHUNK

PROBE_SHAPE = (512, 1024, 1024)  # M (prompt rows in a chunk), K, N: in-cache, GEMM-bound
PROBE_SECONDS = 0.3  # per element type, after a warm-up call
SLOW_S = 0.5  # two calls slower than this are the measurement (bf16 without BF16 units)
DTYPES = ("fp32", "bf16", "int8")


def _operands(dtype: str, m: int, k: int, n: int, gen: torch.Generator) -> Callable[[], object]:
    if dtype == "int8":
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
        b = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
        return lambda: torch._int_mm(a, b)
    float_type = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(m, k, generator=gen).to(float_type)
    b = torch.randn(k, n, generator=gen).to(float_type)
    return lambda: a @ b


def gemm_rate(
    dtype: str, shape: tuple[int, int, int] = PROBE_SHAPE, seconds: float = PROBE_SECONDS
) -> float | None:
    """FLOP/s of the best timed [M, K] x [K, N] product in `dtype` on torch's current threads;
    None where this torch cannot run it here (an int8 GEMM some builds lack)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    try:
        run = _operands(dtype, m, k, n, gen)
        start = time.perf_counter()
        run()  # (warm-up: oneDNN picks and caches its kernel)
    except RuntimeError:
        return None
    first = time.perf_counter() - start
    start = time.perf_counter()
    run()  # (a second call before judging: a warm-up can stall behind another process)
    best = min(first, time.perf_counter() - start)
    if best < SLOW_S:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def gemm_peaks(
    dtypes: tuple[str, ...] = DTYPES, shape: tuple[int, int, int] = PROBE_SHAPE
) -> dict[str, float | None]:
    """FLOP/s per element type (`gemm_rate`), by name."""
    return {dtype: gemm_rate(dtype, shape) for dtype in dtypes}


def prefill_flops(
    config: ModelConfig, tokens: int, start: int = 0, chunk: int = PREFILL_CHUNK
) -> dict[str, float]:
    """FLOPs of a prefill of `tokens` new tokens after `start` cached ones, fed `chunk` at a
    time: "linears" (every projection and the MLP; the LM head for one row a chunk, as each
    chunk computes its last position's logits) and "attention" (causal Q K^T and P V, all
    layers and query heads; a local layer's queries see their sliding window only)."""
    c = config
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_token = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size
    per_token += 3 * c.hidden_size * c.intermediate_size
    heads = -(-tokens // chunk)  # (the chunks: each one's last row through the head)
    linears = (
        2 * tokens * per_token * c.num_hidden_layers + heads * 2 * c.hidden_size * c.vocab_size
    )
    attention = sum(
        attention_flops(c.head_dim, c.num_attention_heads, tokens, start, window)
        for window in c.windows
    )
    return {"linears": float(linears), "attention": float(attention)}


def attention_flops(
    head_dim: int, heads: int, tokens: int, start: int = 0, window: int | None = None
) -> float:
    """FLOPs of one layer's causal attention for `tokens` new queries after `start` cached
    keys: Q K^T and P V over every visible (query, key) pair of every query head (under a
    sliding `window`, a query sees at most `window` keys)."""
    # query i (0-based among the new) sees min(start + i + 1, window) keys: the counts
    # start + 1 .. start + tokens, those above the window capped; 2 products of 2 D FLOPs a pair
    lo, hi = start + 1, start + tokens
    top = hi if window is None else min(hi, window)
    pairs = (lo + top) * (top - lo + 1) / 2 if top >= lo else 0.0
    if window is not None and hi > window:
        pairs += (hi - max(lo, window + 1) + 1) * window
    return 4 * head_dim * pairs * heads


def prefill_compute(
    seconds: float, flops: dict[str, float], peaks: dict, stages: dict[str, float] | None = None
) -> dict:
    """The prefill's line: GFLOP, GFLOP/s, and that rate as a fraction of the best peak; with
    `stages` (seconds of "attention", "quantize" and, where the runner timed them, "linears"
    inside the prefill) the same per stage: the attention's FLOPs over its seconds, the
    linears' over theirs, and "other" (norms, RoPE, the embedding, Python: what is left) in
    seconds. Without a "linears" time the linears' rate is taken over everything left, and
    "other" is absent."""
    total = sum(flops.values())
    rate = total / seconds if seconds else 0.0
    best = max((p for p in peaks.values() if p), default=None)
    line = {
        "gflop": _sig(total / 1e9),
        "gflop_linears": _sig(flops["linears"] / 1e9),
        "gflop_attention": _sig(flops["attention"] / 1e9),
        "gflop_s": _sig(rate / 1e9),
        "fraction_of_peak": _sig(rate / best) if best else None,
    }
    if stages:
        attention, quantize = stages.get("attention", 0.0), stages.get("quantize", 0.0)
        rest = max(seconds - attention - quantize, 0.0)
        # (a linears time of 0: a prefill whose every chunk ran on the C++ step stack)
        linears = min(stages.get("linears") or rest, rest)
        for name, s in (("linears", linears), ("attention", attention)):
            stage_rate = flops[name] / s if s > 0 else 0.0
            line[f"{name}_s"] = _sig(s)
            line[f"{name}_gflop_s"] = _sig(stage_rate / 1e9)
            line[f"{name}_fraction_of_peak"] = _sig(stage_rate / best) if best else None
        line["quantize_s"] = _sig(quantize)
        if stages.get("linears"):
            line["other_s"] = _sig(rest - linears)
    return line


def _sig(x: float) -> float:
    """x to 4 significant digits (a tiny test model's prefill is a few MFLOP)."""
    return float(f"{x:.4g}")
