"""The batch's JSONL output: one JSON object per line, appended whole, held by one process.

A crash or kill -9 can leave at most the last line torn (a record is one `write` of one line,
then fsync): opening the file drops such a tail and says how many bytes went. Any other line
that is not a JSON object means the file is not a qspec batch output, and nothing is touched.
Two batches on one output would interleave and redo each other's work: the file is locked
(`flock`) while open, and a second opener gets a clear error.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from qspec_core.errors import QspecError

RECORD_START = b'{"path": '  # how every record's line begins (`path` is its first key)


class RecordLog:
    """Open with `with RecordLog(path) as log:`; `log.records` holds what was there."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: list[dict] = []
        self.repaired_bytes = 0  # of a torn last line, dropped on open
        self._fd: int | None = None

    def __enter__(self) -> RecordLog:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        path = self.path
        if path.is_dir():
            raise QspecError(f"{path}: is a folder; -o takes a .jsonl file")
        if not path.parent.is_dir():
            raise QspecError(f"{path.parent}: folder does not exist")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise QspecError(f"{path}: cannot open for writing ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise QspecError(
                f"{path}: another qspec batch is writing it; wait for it or pick another -o"
            ) from None
        try:
            self.records, keep = _parse(path, _read_all(fd))
            size = os.fstat(fd).st_size
            if keep < size:
                os.ftruncate(fd, keep)
                os.fsync(fd)
                self.repaired_bytes = size - keep
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (releases the lock)
            self._fd = None

    def append(self, record: dict) -> None:
        """Write `record` as one line, whole, and flush it to disk."""
        if self._fd is None:
            raise RuntimeError("RecordLog is not open")
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)
        self.records.append(record)

    def succeeded(self, sha256: str, settings_key: str) -> dict | None:
        """The latest successful record of this content under these settings, or None."""
        for record in reversed(self.records):
            if (
                record.get("sha256") == sha256
                and record.get("settings_key") == settings_key
                and "error" not in record
            ):
                return record
        return None


def _read_all(fd: int) -> bytes:
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _parse(path: Path, data: bytes) -> tuple[list[dict], int]:
    """(the records, the byte length of the whole lines to keep)."""
    keep = data.rfind(b"\n") + 1  # a tail without its newline is a torn record
    if keep < len(data) and not data[keep:].startswith(RECORD_START[: len(data) - keep]):
        raise QspecError(
            f"{path}: its last line is not a qspec batch record; is this the right file? "
            "(nothing was changed)"
        )
    records = []
    for number, line in enumerate(data[:keep].splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or "path" not in record:
            raise QspecError(
                f"{path}: line {number} is not a qspec batch record; is this the right file? "
                "(nothing was changed)"
            )
        records.append(record)
    return records, keep
