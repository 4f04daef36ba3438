"""Stage timing: `with timer.stage("prefill"): ...` accumulates wall seconds per stage."""

from __future__ import annotations

import time
from contextlib import contextmanager


class StageTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere into stage `name`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def merge(self, other: StageTimer) -> None:
        for name, s in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + s
