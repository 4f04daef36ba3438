"""Stage timing: `with timer.stage("prefill"): ...` accumulates wall seconds per stage;
`StepCosts`, what one decode measured of its step costs, kept for the next one; and the
process's peak memory (`peak_rss_bytes`)."""

from __future__ import annotations

import math
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Step timings that earlier decodes on one runtime measured (seconds), by the context
    they decoded at: `--gamma auto`'s planner (`engine/planner.py`) starts from the nearest
    instead of spending its first round on timing the 4-bit path. Owned by the `Runtime`
    (a chat's questions, a folder's documents share it); each decode's acceptance is its own.
    """

    # context -> (draft step seconds, {verify rows: seconds}), the planner's recent values
    by_context: dict[int, tuple[list[float], dict[int, list[float]]]] = field(default_factory=dict)

    def recall(self, context: int) -> tuple[list[float], dict[int, list[float]]] | None:
        """The timings of the decode nearest `context` (within a factor of 2), or None."""

        def distance(c: int) -> float:  # in octaves
            return abs(math.log2(max(c, 1) / max(context, 1)))

        nearest = min(self.by_context, key=distance, default=None)
        if nearest is None or distance(nearest) > 1:
            return None
        return self.by_context[nearest]

    def keep(self, context: int, draft: list[float], verify: dict[int, list[float]]) -> None:
        """Store a decode's timings (lists the caller no longer changes)."""
        self.by_context[context] = (draft, verify)


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


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far, in bytes (getrusage: kB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
