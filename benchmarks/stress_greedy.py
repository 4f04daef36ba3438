"""Greedy reproducibility under stress: every greedy quantspec run equals target-ar, token for
token, and target-ar equals itself, across gammas, draft sources, forced planner choices,
thread counts, a busy process beside it, and a document prefilled once (a snapshot) or again.

    python benchmarks/stress_greedy.py --tokens 6000 --new 64 --repeats 3 --hog

Prints one line per run and a JSON summary (`--json FILE`); exits 1 on any mismatch. The
small version of this runs in `make test` (tests/test_reproducible.py); this one is for the
long runs an issue or a new CPU calls for (minutes to an hour).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels import MAX_DRAFTS  # noqa: E402
from qspec_core.engine.planner import RoundPlanner  # noqa: E402
from qspec_core.engine.session import SUMMARY_REQUEST, ChatSession  # noqa: E402
from qspec_core.registry.runtime import load_runtime  # noqa: E402
from qspec_core.store.snapshot import load_snapshot, save_snapshot  # noqa: E402


class ForcedPlanner(RoundPlanner):
    """Picks each round's source and length at random (seeded): exactness must not depend on
    what the planner chooses."""

    def __init__(self, limit: int, seed: int):
        super().__init__(limit)
        self.rng = random.Random(seed)

    def plan(self, offers: dict[str, int]) -> tuple[str, int]:
        proposed = offers.get("lookup", 0)
        if proposed and self.rng.random() < 0.4:
            return "lookup", self.rng.randint(1, min(proposed, self.limit))
        return "draft", self.rng.randint(0, self.limit)


@contextlib.contextmanager
def busy_process(on: bool):
    """A CPU-bound process beside the run (threads then wait at barriers for a descheduled
    sibling: a race or a timing-dependent choice shows up more often)."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def answer(session: ChatSession, mode: str, gamma, lookup: bool, planner=None) -> list[int]:
    """The summary's token ids from a fresh session (no earlier turn: nothing reused)."""
    session.mode, session.gamma, session.lookup, session.planner = mode, gamma, lookup, planner
    for _ in session.ask(SUMMARY_REQUEST):
        pass
    return session._cached_ids[session.last.prompt_tokens :]


class Sources:
    """Fresh sessions over one document: restored from a snapshot file (what `qspec summarize
    doc.qspec` does), or prefilled from the text again (`qspec summarize doc.txt`)."""

    def __init__(self, runtime, text: str, new_tokens: int, folder: Path):
        self.runtime, self.text, self.new_tokens = runtime, text, new_tokens
        self.snapshot = folder / "stress.qspec"
        session = self.from_text()
        cache, ids = session.prefill_document()
        rt = runtime
        extra = {"target_weights": rt.target_weights}  # (what `qspec prefill` records)
        save_snapshot(self.snapshot, cache, ids, session.document, rt.folder, rt.name, True, extra)

    def from_text(self) -> ChatSession:
        return ChatSession(self.runtime, self.text, max_new_tokens=self.new_tokens)

    def from_snapshot(self, **options) -> ChatSession:
        """`options`: more ChatSession settings (sampling `params`, `seed`)."""
        rt = self.runtime
        snap = load_snapshot(
            self.snapshot, rt.folder, rt.model, rt.context_limit, None, rt.target_weights
        )
        session = ChatSession(rt, snap.document, max_new_tokens=self.new_tokens, **options)
        session.adopt_cache(snap.cache, snap.token_ids)
        return session


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (one being shorter counts), None if equal."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def configs(gammas: list[int], forced: int):
    yield "target-ar", 4, True, None
    for g in gammas:
        for lookup in (True, False):
            yield "quantspec", g, lookup, None
    yield "quantspec", "auto", True, None
    yield "quantspec", "auto", False, None
    for seed in range(forced):
        yield "quantspec", "auto", True, seed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--document", type=Path, default=ROOT / "qspec_core/data/gpl-3.0.txt")
    ap.add_argument("--tokens", type=int, default=3000, help="document tokens kept")
    ap.add_argument("--new", type=int, default=64, help="new tokens per answer")
    ap.add_argument("--gammas", default=f"1-{MAX_DRAFTS}", help="e.g. 1-16 or 1,4,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--forced", type=int, default=4, help="runs with random planner choices")
    ap.add_argument("--target-weights", default="auto")
    ap.add_argument("--hog", action="store_true", help="a busy process beside every run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    lo, _, hi = args.gammas.partition("-")
    gammas = list(range(int(lo), int(hi) + 1)) if hi else [int(g) for g in args.gammas.split(",")]
    rt = load_runtime(None, log=lambda m: None, need_draft=True, target_weights=args.target_weights)
    tok = rt.tokenizer
    text = tok.decode(tok.encode(args.document.read_text())[: args.tokens])
    runs, reference = [], None
    with tempfile.TemporaryDirectory() as folder, busy_process(args.hog):
        sources = Sources(rt, text, args.new, Path(folder))
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for repeat in range(args.repeats):
                # from the text (the document prefilled again), then from the snapshot
                plan = [("text", "target-ar", 4, True, None), ("text", "quantspec", 4, True, None)]
                plan += [("snapshot", *c) for c in configs(gammas, args.forced)]
                for source, mode, gamma, lookup, seed in plan:
                    planner = None if seed is None else ForcedPlanner(16, seed)
                    t0 = time.perf_counter()
                    session = sources.from_text() if source == "text" else sources.from_snapshot()
                    out = answer(session, mode, gamma, lookup, planner)
                    reference = reference or out
                    ok = out == reference
                    run = dict(threads=threads, repeat=repeat, source=source, mode=mode,
                               gamma=gamma, lookup=lookup, forced_seed=seed, tokens=len(out),
                               equal=ok, first_difference=first_difference(out, reference),
                               seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
                    runs.append(run)
                    print(("ok  " if ok else "DIFF"), json.dumps(run), flush=True)
    bad = [r for r in runs if not r["equal"]]
    summary = {
        "target_weights": rt.target_weights,
        "dtype": str(rt.model.dtype).removeprefix("torch."),
        "document_tokens": args.tokens,
        "new_tokens": args.new,
        "hog": args.hog,
        "runs": len(runs),
        "mismatches": len(bad),
        "detail": runs,
    }
    print(f"{len(runs) - len(bad)} of {len(runs)} runs equal target-ar's first run")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
