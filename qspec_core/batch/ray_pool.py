"""A batch on Ray (`qspec summarize DIR -o out.jsonl --ray ADDRESS|local`, `pip install
qspec[ray]`): one actor per worker holds the model; each document is a task on an actor.

The document's bytes travel with its task, so the workers need no shared disk (`--snapshots`
does need a folder every worker sees). An actor whose process dies (kill -9, a lost node) is
restarted by Ray, which reloads the model and runs the task again (`max_restarts`,
`max_task_retries`); a task that still fails becomes an error record. The driver, not the
actors, writes the records. `local` starts a private Ray instance on this machine sized to the
workers and stops it at the end; an ADDRESS joins a running cluster ("auto", "ray://...").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from qspec_core.batch.job import BatchSettings, summarize_document
from qspec_core.errors import QspecError


class _Summarizer:
    """The actor: one model, loaded once."""

    def __init__(self, settings: BatchSettings, threads: int, snapshots: str | None):
        from qspec_core.batch.workers import load_for

        self.settings, self.snapshots = settings, snapshots
        self.runtime = load_for(settings, threads)

    def pid(self) -> int:
        import os

        return os.getpid()

    def summarize(self, path: str, data: bytes) -> dict:
        return summarize_document(self.runtime, Path(path), self.settings, self.snapshots, data)


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
    ):
        ray = self.ray = import_ray()
        self.settings = settings
        self._started = False
        quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            if address == "local":
                ray.init(num_cpus=n * threads, **quiet)
                self._started = True
            else:
                ray.init(address=address, **quiet)
        except Exception as e:  # noqa: BLE001 (Ray raises many kinds; one clear line)
            raise QspecError(f"--ray {address}: cannot start or join Ray ({e})") from None
        actor = ray.remote(num_cpus=threads, max_restarts=retries, max_task_retries=retries)
        snap = None if snapshots is None else str(snapshots)
        self.actors = [actor(_Summarizer).remote(settings, threads, snap) for _ in range(n)]

    def run(self, paths: list[Path]) -> Iterator[dict]:
        ray = self.ray
        todo = list(reversed(paths))
        free = list(self.actors)
        pending: dict = {}  # object ref -> (path, actor)
        while todo or pending:
            while free and todo:
                path = todo.pop()
                try:
                    data = path.read_bytes()
                except OSError as e:
                    yield self._error(path, f"{path}: cannot read ({e.strerror or e})")
                    continue
                actor = free.pop()
                pending[actor.summarize.remote(str(path), data)] = (path, actor)
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
        return {
            "path": str(path),
            "sha256": None,
            "settings_key": self.settings.key(),
            "error": why,
        }

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()
            self._started = False
