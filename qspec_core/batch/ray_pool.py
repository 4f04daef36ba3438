"""A batch on Ray (`qspec summarize DIR -o out.jsonl --ray ADDRESS|local`, `pip install
qspec[ray]`): one actor per worker holds the model; each document is a task on an actor.

The document's bytes travel with its task, so the workers need no shared disk (`--snapshots`
does need a folder every worker sees). An actor whose process dies (kill -9, a lost node) is
restarted by Ray, which reloads the model and runs the task again (`max_restarts`,
`max_task_retries`); a task that still fails becomes an error record. The driver, not the
actors, writes the records. `local` starts a private Ray instance on this machine sized to the
workers and stops it at the end; an ADDRESS joins a running cluster ("auto", "ray://...").

Joining is checked first with a plain TCP connect (an unreachable address fails in
`join_timeout` seconds with one message, instead of Ray's minutes of retries), and what Ray's
C++ core writes to stderr while it starts or stops goes to `log_path`, not the terminal.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qspec_core.batch.job import BatchSettings, summarize_document
from qspec_core.batch.records import new_record
from qspec_core.documents import read_document_bytes
from qspec_core.errors import QspecError


class _Summarizer:
    """The actor: one model, loaded once."""

    def __init__(self, settings: BatchSettings, threads: int, snapshots: str | None):
        from qspec_core.batch.workers import load_for

        self.settings, self.snapshots = settings, snapshots
        self.runtime = load_for(settings, threads)

    def pid(self) -> int:
        return os.getpid()

    def summarize(self, path: bytes, data: bytes) -> dict:
        # (the name travels as its bytes: any name a file system allows, not only UTF-8)
        path = Path(os.fsdecode(path))
        return summarize_document(self.runtime, path, self.settings, self.snapshots, data)


def import_ray():
    try:
        import ray
    except ImportError:
        raise QspecError("--ray needs Ray: pip install 'qspec[ray]' (or pip install ray)") from None
    return ray


class RayActors:
    def __init__(
        self,
        settings: BatchSettings,
        address: str,
        n: int,
        threads: int,
        snapshots: Path | None = None,
        retries: int = 2,
        log_path: Path | None = None,
        join_timeout: float = 10.0,
    ):
        ray = self.ray = import_ray()
        self.settings, self.log_path = settings, log_path
        self._started = False
        quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if address not in ("local", "auto"):
            check_reachable(address, join_timeout)
        try:
            with _stderr_to(log_path):
                if address == "local":
                    ray.init(num_cpus=n * threads, **quiet)
                    self._started = True
                else:
                    ray.init(address=address, **quiet)
        except Exception as e:  # noqa: BLE001 (Ray raises many kinds; one clear line)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = f"; Ray's log: {log_path}" if log_path is not None else ""
            raise QspecError(
                f"--ray {address}: cannot start or join Ray ({first}){where}"
            ) from None
        self._actor_args = (n, threads, None if snapshots is None else str(snapshots), retries)
        self.actors: list = []

    def start(self) -> None:
        """The actors, each loading the model: after the driver's conversion step."""
        n, threads, snapshots, retries = self._actor_args
        actor = self.ray.remote(num_cpus=threads, max_restarts=retries, max_task_retries=retries)
        self.actors = [
            actor(_Summarizer).remote(self.settings, threads, snapshots) for _ in range(n)
        ]

    def run(self, paths: list[Path]) -> Iterator[dict]:
        ray = self.ray
        if not self.actors and paths:
            self.start()
        todo = list(reversed(paths))
        free = list(self.actors)
        pending: dict = {}  # object ref -> (path, actor)
        while todo or pending:
            while free and todo:
                path = todo.pop()
                try:
                    data = read_document_bytes(path)  # (never a FIFO's endless wait)
                except QspecError as e:
                    yield self._error(path, str(e))
                    continue
                actor = free.pop()
                pending[actor.summarize.remote(os.fsencode(path), data)] = (path, actor)
            if not pending:
                continue
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            path, actor = pending.pop(ref)
            try:
                record = ray.get(ref)
                free.append(actor)
            except ray.exceptions.RayActorError:  # restarted `retries` times: gone for good
                record = self._error(path, "its Ray worker died more often than --ray retries")
            except ray.exceptions.RayError as e:
                free.append(actor)
                record = self._error(path, f"the Ray worker failed on it: {type(e).__name__}")
            yield record
            if not free and not pending:  # every actor is gone: the rest cannot run
                while todo:
                    yield self._error(todo.pop(), "no Ray worker left to run it")

    def _error(self, path: Path, why: str) -> dict:
        return new_record(path, self.settings.key(), error=why)

    def close(self) -> None:
        if self._started:
            with _stderr_to(self.log_path):
                self.ray.shutdown()
            self._started = False


def check_reachable(address: str, timeout: float) -> None:
    """QspecError unless `address` ("host:port" or "ray://host:port") accepts a TCP connection
    within `timeout` seconds."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise QspecError(
            f"--ray {address}: not an address (local, auto, HOST:PORT, ray://HOST:PORT)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise QspecError(f"--ray {address}: cannot reach {hostport} ({why})") from None


@contextmanager
def _stderr_to(log_path: Path | None):
    """File descriptor 2 appended to `log_path` for the duration (None: left alone): Ray's C++
    core writes its retries and warnings there directly, past Python's sys.stderr."""
    if log_path is None:
        yield
        return
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
