"""The batch's JSONL output: one JSON object per line, appended whole, held by one process.

Every record begins `{"qspec_batch": 1, "path": ...`: the format's name and version, so that
a JSONL file of anything else is never taken for a batch log and appended to. A file name
that is not UTF-8 cannot be JSON text: `path` shows it with \\xNN escapes and `path_b64`
holds its exact bytes (`path_bytes` decodes either form).

A crash or kill -9 can leave at most the last line torn (a record is one `write` of one line,
then fsync): opening the file drops such a tail and says how many bytes went. A write that
fails (a full disk) is cut back at once to the last whole record. Any other line
that is not a record means the file is not a qspec batch output, and nothing is touched (a log
of qspec 0.x, whose records had no tag, is refused with a way to convert it).
Two batches on one output would interleave and redo each other's work: the file is locked
(`flock`) while open, and a second opener gets a clear error.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import stat
from pathlib import Path

from qspec_core.documents import display_name, printable
from qspec_core.errors import QspecError, disk_space

FORMAT, VERSION = "qspec_batch", 1
RECORD_START = b'{"qspec_batch": 1, "path": '  # how every record's line begins
UNTAGGED_START = b'{"path": '  # how a record of the first batch format (no tag) began


def new_record(path: str | Path, settings_key: str, **fields) -> dict:
    """A record of document `path`, its fields in the order of RECORD_START."""
    record = {FORMAT: VERSION, "path": display_name(path)}
    exact = os.fsencode(path)
    if exact != record["path"].encode():  # (not UTF-8: `path` alone would lose bytes)
        record["path_b64"] = base64.b64encode(exact).decode()
    return record | {"sha256": None, "settings_key": settings_key} | fields


def path_bytes(record: dict) -> bytes:
    """The exact file name of a record (`os.fsencode` form)."""
    if "path_b64" in record:
        return base64.b64decode(record["path_b64"])
    return record["path"].encode()


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

    def check(self) -> None:
        """What `open` refuses, found without creating, locking or changing anything: run
        before the batch starts anything (a model load, a cluster join)."""
        path = self.path
        if path.is_dir():
            raise QspecError(f"{display_name(path)}: is a folder; -o takes a .jsonl file")
        if not path.parent.is_dir():
            blocker = next((p for p in path.parents if p.exists()), None)
            if blocker is not None and not blocker.is_dir():
                raise QspecError(
                    f"{display_name(path)}: {display_name(blocker)} is a file, not a folder"
                )
            raise QspecError(f"{display_name(path.parent)}: folder does not exist")
        if path.exists():
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                raise QspecError(f"{display_name(path)}: cannot read ({e.strerror or e})") from None
            try:
                _check_regular(fd, path)
                _parse(path, _read_all(fd))
            finally:
                os.close(fd)

    def open(self) -> None:
        self.check()
        path = self.path
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            why = e.strerror or e
            raise QspecError(f"{display_name(path)}: cannot open for writing ({why})") from None
        try:
            _check_regular(fd, path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise QspecError(
                f"{display_name(path)}: another qspec batch is writing it; wait for it or pick "
                "another -o"
            ) from None
        except BaseException:
            os.close(fd)
            raise
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
        line = json.dumps(_printable(record), ensure_ascii=False)
        data = (line + "\n").encode()
        view = memoryview(data)
        end = os.fstat(self._fd).st_size  # of the whole records: where a failed write is cut
        try:
            with disk_space(self.path):
                while view:
                    view = view[os.write(self._fd, view) :]
                os.fsync(self._fd)
        except BaseException:
            _cut_back(self._fd, end)  # (a full disk, Ctrl-C mid-write: no torn record stays)
            raise
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


def _cut_back(fd: int, size: int) -> None:
    """Truncate the log back to `size` bytes (its whole records); best effort, as a torn tail
    is also dropped when the log is next opened."""
    try:
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
            os.fsync(fd)
    except OSError:
        pass


def _printable(value):
    """`value` with any lone surrogate (a non-UTF-8 file name inside a message) as \\xNN: the
    line must be UTF-8, and one such name must not cost the record (`path_b64` is exact)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {key: _printable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(item) for item in value]
    return value


def _read_all(fd: int) -> bytes:
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _check_regular(fd: int, path: Path) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise QspecError(f"{display_name(path)}: not a regular file; -o takes a .jsonl file")


def _parse(path: Path, data: bytes) -> tuple[list[dict], int]:
    """(the records, the byte length of the whole lines to keep)."""
    name = display_name(path)
    keep = data.rfind(b"\n") + 1  # a tail without its newline is a torn record
    records = []
    for number, line in enumerate(data[:keep].splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if isinstance(record, dict) and record.get(FORMAT) == VERSION and "path" in record:
            records.append(record)
            continue
        later = isinstance(record, dict) and isinstance(record.get(FORMAT), int)
        if later and record[FORMAT] > VERSION:
            raise QspecError(
                f"{name}: line {number} was written by a later qspec (batch format "
                f"{record[FORMAT]}; this one reads {VERSION}); upgrade qspec or give another -o "
                "(nothing was changed)"
            )
        if not records and line.startswith(UNTAGGED_START) and isinstance(record, dict):
            _refuse_untagged(name)
        raise QspecError(
            f"{name}: line {number} is not a qspec batch record (version {VERSION}); is this "
            "the right file? (nothing was changed)"
        )
    tail = data[keep:]
    if tail and not RECORD_START.startswith(tail[: len(RECORD_START)]):
        if not records and tail.startswith(UNTAGGED_START):
            _refuse_untagged(name)
        raise QspecError(
            f"{name}: its last line is not a qspec batch record; is this the right file? "
            "(nothing was changed)"
        )
    return records, keep


def _refuse_untagged(name: str) -> None:
    raise QspecError(
        f'{name}: a batch log of an earlier qspec (records without "{FORMAT}"), or not a '
        "batch log at all; nothing was changed. Give a new -o file (the documents are "
        f'summarized again), or tag its records first: sed -i \'s/^{{"path": '
        f'/{{"{FORMAT}": {VERSION}, "path": /\' {name}'
    )
