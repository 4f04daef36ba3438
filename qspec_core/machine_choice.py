"""A choice between CPU paths that compute alike, made by timing them once per machine and
kept in the qspec cache: later runs on that machine take the same path, so they compute the
same numbers and greedy output stays reproducible from run to run (README).

Used by `runner/prefill_choice.py` (the INT8 layers' many-row products) and
`runner/products_choice.py` (the prefill attention's products). Each keeps a JSON file in the
qspec cache, {machine key: {"path": name, "seconds": {name: s}}}; the key says what the
timings depend on (the CPU's model and flags, torch, the kernels' version).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

from qspec_core.paths import qspec_home

try:
    import fcntl
except ImportError:  # (Windows: no lock; two first runs may each measure)
    fcntl = None


@lru_cache(maxsize=1)
def cpu_description() -> str:
    """This CPU's model name and flags (what /proc/cpuinfo says; the platform's name else)."""
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        if lines:
            return "\n".join(sorted(set(lines)))
    return platform.processor() or platform.machine()


def best_in_turns(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of each of `runs` (already warmed up): the best of `repeats`, taken in turns
    (A B C A B C ...) so that a busy moment slows every candidate alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@lru_cache(maxsize=16)
def machine_hash(*parts: object) -> str:
    """A short key for `parts` (hashed once: a prefill asks for its paths on every layer)."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _read(path: Path, key: str, options: Sequence[str]) -> dict | None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        record = json.loads(path.read_text()).get(key, {})
        if record.get("path") in options:
            seconds = record.get("seconds")
            return {"path": record["path"], "seconds": seconds if isinstance(seconds, dict) else {}}
    return None


def measured_record(
    file: str,
    key: str,
    options: Sequence[str],
    measure: Callable[[], dict[str, float]],
    fallback: str,
) -> dict:
    """{"path": the path kept for `key` in the qspec cache's `file`, "seconds": {path: s} as
    measured}, else the fastest of `measure()` ({path: seconds}; `fallback` when it timed none)
    written there, under a lock so two first runs at once agree. Without a writable cache:
    measured, not kept. A damaged file is measured over and rewritten whole (written aside,
    then renamed)."""
    folder = qspec_home()
    path = folder / file
    found = _read(path, key, options)
    if found is not None:
        return found
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(folder / (file + ".lock"), "a"))
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        found = _read(path, key, options)  # (another process measured while we waited)
        if found is not None:
            return found
        seconds = {k: round(v, 6) for k, v in measure().items()}
        choice = min(seconds, key=seconds.get) if seconds else fallback
        table = {}
        with contextlib.suppress(OSError, ValueError):
            table = json.loads(path.read_text())
        table = table if isinstance(table, dict) else {}
        with contextlib.suppress(OSError):
            table[key] = {"path": choice, "seconds": seconds}
            tmp = path.with_name(f"{file}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1) + "\n")
            os.replace(tmp, path)
        return {"path": choice, "seconds": seconds}


def measured_choice(
    file: str,
    key: str,
    options: Sequence[str],
    measure: Callable[[], dict[str, float]],
    fallback: str,
) -> str:
    """The path of `measured_record(file, key, options, measure, fallback)`."""
    return measured_record(file, key, options, measure, fallback)["path"]
