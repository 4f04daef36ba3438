"""Reading user documents, with one clear error per way a file can be unusable."""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import io
import os
import stat
import sys
from pathlib import Path
from typing import BinaryIO

from qspec_core.errors import QspecError

STDIN = "-"  # the document name that means standard input
SNIFF_BYTES = 65536  # a NUL byte this early means binary; checked before reading the rest
# Far beyond any model's context (32k tokens are ~130 KB), yet a bound: `/dev/zero`,
# `/dev/urandom` or a runaway pipe must not be read until memory runs out.
MAX_DOCUMENT_BYTES = 256 * 2**20


def is_stdin(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDIN


def read_document(path: str | Path) -> str:
    """The UTF-8 text of `path` (`-`: standard input), read exactly once, so that a pipe
    works; QspecError if missing, not a regular file, unreadable, empty, binary, not UTF-8 or
    huge."""
    return read_document_digest(path)[0]


def read_document_digest(path: str | Path) -> tuple[str, str]:
    """(`read_document(path)`, the sha256 of the bytes read), from one read."""
    if is_stdin(path):
        name = "standard input (-)"
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:
            raise QspecError(f"{name}: not available")
        data = _read(stream, name)
        return _decode(data, name), hashlib.sha256(data).hexdigest()
    data = read_document_bytes(path)
    return _decode(data, display_name(path)), hashlib.sha256(data).hexdigest()


def decode_document(data: bytes, name: str) -> tuple[str, str]:
    """`read_document_digest` of bytes already read (a document sent to a remote worker)."""
    return _decode(_read(io.BytesIO(data), name), name), hashlib.sha256(data).hexdigest()


def display_name(path: str | Path) -> str:
    """`path` as printable text: bytes that are not UTF-8 (`os.fsencode`) shown as \\xNN.
    Python keeps such bytes as lone surrogates, which no UTF-8 writer (a terminal, a JSON
    record) accepts; this form is for people, the exact bytes are `os.fsencode(path)`."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def printable(text: str) -> str:
    """`text` (a message that may hold a `display_name`-less path) as valid UTF-8: the bytes
    of a non-UTF-8 file name as \\xNN, any other lone surrogate as \\udXXX."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def open_document(path: str | Path) -> BinaryIO:
    """`path` opened for reading, if it is a regular file or a pipe we were handed (/dev/stdin,
    <(...)); QspecError otherwise. A FIFO made with mkfifo would block the open until some
    process writes to it, maybe never: it is refused (`-` reads standard input), and so are
    sockets and device nodes (/dev/zero never ends)."""
    name = display_name(path)
    try:
        _check_kind(os.stat(path), name)
        # O_NONBLOCK: what we opened may not be what we stat'ed (a FIFO swapped in), and
        # opening a FIFO without it would wait for a writer; the opened fd decides
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.islink(path):
            target = display_name(os.readlink(path))
            raise QspecError(f"{name}: a symlink to nothing ({target} does not exist)") from None
        raise QspecError(f"{name}: no such file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise QspecError(f"{name}: a symlink loop (it never reaches a file)") from None
        raise QspecError(f"{name}: cannot read ({e.strerror or e})") from None
    try:
        _check_kind(os.fstat(fd), name)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _check_kind(st: os.stat_result, name: str) -> None:
    mode = st.st_mode
    if stat.S_ISREG(mode) or (stat.S_ISFIFO(mode) and st.st_dev == _pipe_device()):
        return  # (an anonymous pipe always came with its writer, unlike a named FIFO)
    if stat.S_ISDIR(mode):
        raise QspecError(f"{name}: is a folder, not a text file")
    if stat.S_ISFIFO(mode):
        raise QspecError(
            f"{name}: is a FIFO, not a regular file (to read a FIFO, pipe it to standard "
            "input: qspec ... - < FIFO)"
        )
    kind = "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise QspecError(f"{name}: is {kind}, not a regular file")


@functools.cache
def _pipe_device() -> int:
    """The device number of anonymous pipes (pipefs), which named FIFOs never share."""
    read_end, write_end = os.pipe()
    try:
        return os.fstat(read_end).st_dev
    finally:
        os.close(read_end)
        os.close(write_end)


def read_document_bytes(path: str | Path) -> bytes:
    """The bytes of document `path` with `read_document`'s checks on kind, NUL bytes, size."""
    name = display_name(path)
    try:
        with open_document(path) as f:
            return _read(f, name)
    except OSError as e:
        raise QspecError(f"{name}: cannot read ({e.strerror or e})") from None


# byte-order marks of the wide encodings, UTF-32's first (its LE mark begins with UTF-16's)
_WIDE_MARKS = (
    (b"\xff\xfe\x00\x00", 32), (b"\x00\x00\xfe\xff", 32), (b"\xff\xfe", 16), (b"\xfe\xff", 16),
)  # fmt: skip


def _read(stream: BinaryIO, name) -> bytes:
    head = stream.read(SNIFF_BYTES)
    for mark, width in _WIDE_MARKS:
        if head.startswith(mark):
            raise QspecError(
                f"{name}: UTF-{width} text (it starts with a UTF-{width} byte-order mark); qspec "
                f"reads UTF-8: convert it first, e.g. iconv -f UTF-{width} -t UTF-8"
            )
    if b"\x00" in head:
        raise QspecError(f"{name}: looks binary (NUL bytes); qspec reads UTF-8 text files")
    rest = stream.read(MAX_DOCUMENT_BYTES + 1 - len(head))
    if len(head) + len(rest) > MAX_DOCUMENT_BYTES:
        raise QspecError(f"{name}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB; not a document")
    return head + rest


def _decode(data: bytes, name) -> str:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise QspecError(
            f"{name}: not UTF-8 text (invalid byte at offset {e.start}); convert it first, "
            f"e.g. iconv -f latin1 -t utf-8"
        ) from None
    # emptiness is judged on the text: a byte-order mark (U+FEFF) alone is not content
    if not text.replace("\ufeff", "").strip():
        if text.replace("\ufeff", ""):
            raise QspecError(f"{name}: holds only whitespace, no text")
        raise QspecError(f"{name}: file is empty")
    return text.replace("\r\n", "\n")
