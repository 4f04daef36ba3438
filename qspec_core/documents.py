"""Reading user documents, with one clear error per way a file can be unusable."""

from __future__ import annotations

from pathlib import Path

from qspec_core.errors import QspecError


def read_document(path: str | Path) -> str:
    """The UTF-8 text of `path`; QspecError if missing, unreadable, empty, binary or not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise QspecError(f"{path}: no such file")
    if path.is_dir():
        raise QspecError(f"{path}: is a folder, not a text file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise QspecError(f"{path}: cannot read ({e.strerror})") from None
    if not data.strip():
        raise QspecError(f"{path}: file is empty")
    if b"\x00" in data[:65536]:
        raise QspecError(f"{path}: looks binary (NUL bytes); qspec reads UTF-8 text files")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise QspecError(
            f"{path}: not UTF-8 text (invalid byte at offset {e.start}); convert it first, "
            f"e.g. iconv -f latin1 -t utf-8"
        ) from None
    return text.replace("\r\n", "\n")
