"""Where a batch's documents run. Each executor takes the paths to do and yields one record per
path, in the order they finish; the driver (`batch.run`) writes them.

    InProcess     this process, one model load (the default; what `--workers 1` means)
    LocalWorkers  N processes on this machine, the threads split between them, one model each;
                  a worker that dies (kill -9, out of memory) is replaced and its document
                  retried, up to `retries` times, then recorded as an error
    (Ray actors: `batch/ray_pool.py`)

Worker processes are spawned (not forked: the parent's OpenMP pool does not survive a fork)
and load the model with `registry.runtime.load_runtime`: the driver runs the conversion step
once before any starts (`registry.prepare.prepare_for`), so workers never convert.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from multiprocessing.connection import wait
from pathlib import Path

from qspec_core.batch.job import BatchSettings, summarize_document
from qspec_core.batch.records import new_record
from qspec_core.errors import QspecError


def load_for(settings: BatchSettings, threads: int | None = None):
    """The runtime a batch's documents need (no conversion: see the module docstring)."""
    import torch

    from qspec_core.registry.runtime import load_runtime

    if threads:
        torch.set_num_threads(threads)
    return load_runtime(
        settings.model,
        settings.dtype,
        need_draft=settings.mode == "quantspec",
        target_weights=settings.target_weights,
        log=lambda msg: None,
        full_weights=False,  # (every mode runs the target weights and the draft)
    )


class InProcess:
    def __init__(self, runtime, settings: BatchSettings, snapshots: Path | None = None):
        self.runtime, self.settings, self.snapshots = runtime, settings, snapshots

    def run(self, paths: list[Path]) -> Iterator[dict]:
        for path in paths:
            yield summarize_document(self.runtime, path, self.settings, self.snapshots)

    def close(self) -> None:
        pass


def _worker_main(conn, settings: BatchSettings, threads: int, snapshots) -> None:
    """A worker process: load once, then summarize each path the driver sends (None: stop).
    Ctrl-C is the driver's to handle: it stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runtime = load_for(settings, threads)
    except BaseException as e:  # noqa: BLE001 (reported to the driver, which stops the batch)
        why = str(e) if isinstance(e, QspecError) else f"{type(e).__name__}: {e}"
        conn.send(("fatal", why))
        return
    conn.send(("ready", None))
    while True:
        try:
            path = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if path is None:
            return
        path = Path(os.fsdecode(path))  # (sent as bytes: any name a file system allows)
        conn.send(("record", summarize_document(runtime, path, settings, snapshots)))


class LocalWorkers:
    """`n` worker processes with `threads` threads each."""

    def __init__(
        self,
        settings: BatchSettings,
        n: int,
        threads: int,
        snapshots: Path | None = None,
        retries: int = 2,
    ):
        self.settings, self.n, self.threads, self.snapshots = settings, n, threads, snapshots
        self.retries = retries
        self._ctx = mp.get_context("spawn")
        self._workers: dict = {}  # process -> connection

    def _start(self):
        ours, theirs = self._ctx.Pipe()
        args = (theirs, self.settings, self.threads, self.snapshots)
        proc = self._ctx.Process(target=_worker_main, args=args, daemon=True)
        proc.start()
        theirs.close()
        self._workers[proc] = ours
        return proc

    def run(self, paths: list[Path]) -> Iterator[dict]:
        todo = list(reversed(paths))  # (popped from the end: in order)
        tries: dict[Path, int] = {}
        busy: dict = {}  # process -> the path it holds
        idle = []
        for _ in range(min(self.n, len(paths))):
            self._start()
        while todo or busy:
            while idle and todo:
                proc = idle.pop()
                busy[proc] = todo.pop()
                try:
                    self._workers[proc].send(os.fsencode(busy[proc]))
                except OSError:
                    pass  # it died: its sentinel brings the path back
            owner = {conn: proc for proc, conn in self._workers.items()}
            owner |= {proc.sentinel: proc for proc in self._workers}
            for item in wait(list(owner)):
                proc = owner[item]
                if proc not in self._workers:
                    continue  # (its connection and its sentinel both woke us: handled)
                conn, dead = self._workers[proc], item == proc.sentinel
                while True:  # every message it sent, before its death if it died
                    try:
                        if not conn.poll():
                            break
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        dead = True
                        break
                    if kind == "fatal":
                        raise QspecError(f"a worker could not load the model: {payload}")
                    if kind == "record":
                        busy.pop(proc, None)
                        yield payload
                    idle.append(proc)  # ("ready", or done with its document)
                if dead:
                    record = self._died(proc, busy, idle, todo, tries)
                    if record is not None:
                        yield record

    def _died(self, proc, busy, idle, todo, tries) -> dict | None:
        self._workers.pop(proc).close()
        if proc in idle:
            idle.remove(proc)
        path = busy.pop(proc, None)
        record = None
        if path is not None:
            tries[path] = tries.get(path, 0) + 1
            if tries[path] > self.retries:
                why = f"a worker died on it {tries[path]} times (exit code {proc.exitcode})"
                record = new_record(path, self.settings.key(), error=why)
            else:
                todo.append(path)  # next, on a fresh worker
        if todo and len(self._workers) < self.n:
            self._start()
        return record

    def close(self) -> None:
        for conn in list(self._workers.values()):
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in list(self._workers):
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._workers.clear()
