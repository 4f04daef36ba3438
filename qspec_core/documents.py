"""Reading user documents, with one clear error per way a file can be unusable."""

from __future__ import annotations

import hashlib
import io
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
    """The UTF-8 text of `path` (`-`: standard input), read exactly once, so that a FIFO or
    a pipe works; QspecError if missing, unreadable, empty, binary, not UTF-8 or huge."""
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
    data = _read_file(Path(path))
    return _decode(data, path), hashlib.sha256(data).hexdigest()


def decode_document(data: bytes, name: str) -> tuple[str, str]:
    """`read_document_digest` of bytes already read (a document sent to a remote worker)."""
    return _decode(_read(io.BytesIO(data), name), name), hashlib.sha256(data).hexdigest()


def _read_file(path: Path) -> bytes:
    if not path.exists():
        raise QspecError(f"{path}: no such file")
    if path.is_dir():
        raise QspecError(f"{path}: is a folder, not a text file")
    try:
        with open(path, "rb") as f:
            return _read(f, path)
    except OSError as e:
        raise QspecError(f"{path}: cannot read ({e.strerror or e})") from None


def _read(stream: BinaryIO, name) -> bytes:
    head = stream.read(SNIFF_BYTES)
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
        raise QspecError(f"{name}: file is empty")
    return text.replace("\r\n", "\n")
