"""What every device_check section runs in: the settings (real and dry-run shapes), the
report that keeps partial results on disk after every item, and the timers."""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

PEAK_GBPS = 4800.0  # H200 HBM3e


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    heads: int  # query heads
    kv_heads: tuple[int, ...]
    head_dim: int
    group: int  # KV quantization group G
    check_length: int  # correctness context (crosses a group boundary for T = 5)
    chunks: tuple[int | None, ...]  # chunk sizes checked (None: the default)
    lengths: tuple[int, ...]  # attention timing contexts
    queries: tuple[int, ...]  # T: 1 for a draft step, 5 for a verify (gamma = 4)
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    weight_group: int  # W4A16 group
    gemm_shapes: tuple[tuple[int, int], ...]  # (K, N): y[M, N] = x[M, K] W^T
    gemm_rows: tuple[int, ...]  # M
    pack_tokens: tuple[int, ...]
    pack_kv_heads: int
    model_lengths: tuple[int, ...]
    model_kv_heads: tuple[int, ...]
    distinct_layers: int = 2  # weight/cache sets cycled over the layers (each exceeds L2)


REAL = Settings(
    device="cuda", dtype="bfloat16", heads=32, kv_heads=(8, 32), head_dim=128, group=128,
    check_length=4094, chunks=(None, 1000), lengths=(4096, 32768, 131072), queries=(1, 5),
    layers=32, hidden=4096, intermediate=11008, vocab=32000, weight_group=128,
    gemm_shapes=((4096, 4096), (4096, 11008), (11008, 4096)), gemm_rows=(1, 5),
    pack_tokens=(128, 4096), pack_kv_heads=32, model_lengths=(4096, 32768, 131072),
    model_kv_heads=(8, 32),
)  # fmt: skip
DRY = Settings(
    device="cpu", dtype="bfloat16", heads=4, kv_heads=(2,), head_dim=64, group=32,
    check_length=94, chunks=(None, 40), lengths=(96,), queries=(1, 5),
    layers=1, hidden=256, intermediate=256, vocab=256, weight_group=128,
    gemm_shapes=((256, 256),), gemm_rows=(1, 5),
    pack_tokens=(64,), pack_kv_heads=2, model_lengths=(96,), model_kv_heads=(1,),
    distinct_layers=1,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Report: partial results on disk after every item


class Report:
    def __init__(self, out: Path, deadline: float):
        self.out = out
        self.deadline = deadline
        self.data: dict = {"errors": [], "skipped": []}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def item(self, name: str, min_seconds: float = 0.0):
        """Run one item: errors are recorded (and printed), never raised; items that would
        start with less than min_seconds left are skipped."""
        if self.time_left() < min_seconds:
            self.data["skipped"].append(name)
            print(f"[skip] {name}: out of time", flush=True)
            self.save_part()
            yield False
            return
        t0 = time.monotonic()
        try:
            yield True
            print(f"[ok] {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as exc:  # the point is to keep going
            self.data["errors"].append(
                {
                    "item": name,
                    "error": repr(exc)[:500],
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
            print(f"[error] {name}: {exc!r}"[:400], flush=True)
            cuda_cleanup()
        finally:
            self.save_part()

    def save_part(self, name: str = "part.json") -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / name).write_text(json.dumps(self.data, indent=1, default=str))


def cuda_cleanup() -> None:
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Timing


def bench_ms(fn, s: Settings) -> float:
    """Median milliseconds per call. CUDA: triton's do_bench (flushes L2 between calls, as the
    other layers would), else CUDA events. CPU (dry run): one call (the interpreter has
    nothing to warm up, and its times mean nothing)."""
    if s.device == "cuda":
        import triton.testing

        try:
            return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
        except Exception:  # an older or odd triton: time it by hand
            return event_ms(fn, reps=20)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def event_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, reps: int = 10) -> float:
    """Milliseconds per replay of fn captured in a CUDA graph (no host launch overhead)."""
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return event_ms(graph.replay, reps)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9
