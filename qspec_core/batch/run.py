"""The driver of a batch: what is left to do, and the records written as they come.

plan     the documents whose content (sha256) already has a successful record under the
         same settings are skipped; the rest (new, changed, failed before) are to do
execute  an executor (`batch.workers`, `batch.ray_pool`) runs them; each record is
         appended whole to the output as soon as it arrives, so Ctrl-C or a crash loses
         at most the documents in flight, and a rerun resumes
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from qspec_core.batch.job import BatchSettings
from qspec_core.batch.records import RecordLog
from qspec_core.documents import open_document
from qspec_core.errors import QspecError


def content_sha256(path: Path) -> str | None:
    """The sha256 of a file's bytes (what a record's `sha256` is), None if unreadable or not a
    document (a FIFO, a device: never opened in a way that blocks or never ends)."""
    digest = hashlib.sha256()
    try:
        with open_document(path) as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except (OSError, QspecError):
        return None
    return digest.hexdigest()


def plan(
    paths: list[Path], log: RecordLog, settings: BatchSettings
) -> tuple[list[Path], list[Path]]:
    """(to do, skipped: already summarized with these settings)."""
    key = settings.key()
    todo, skipped = [], []
    for path in paths:
        sha = content_sha256(path)
        if sha is not None and log.succeeded(sha, key) is not None:
            skipped.append(path)
        else:
            todo.append(path)
    return todo, skipped


def execute(
    todo: list[Path], log: RecordLog, executor, on_record: Callable[[dict], None] | None = None
) -> list[dict]:
    """Run `todo` on `executor`, appending each record to `log`; returns the failed records."""
    failed = []
    for record in executor.run(todo):
        log.append(record)
        if "error" in record:
            failed.append(record)
        if on_record is not None:
            on_record(record)
    return failed
