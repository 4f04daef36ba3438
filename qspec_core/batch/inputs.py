"""The documents of a batch: FILE|DIR... expanded, de-duplicated and sorted.

A file named on the command line is taken whatever its name; a folder gives the text files
under it (recursively, by suffix, see TEXT_SUFFIXES), skipping hidden files and folders
(".git", ".cache", ...) and qspec's own outputs. Symlinks to files are followed; a folder
reached twice (a symlink loop) is read once, and a file reached under two paths is one
document. A dangling link, a link loop, a FIFO, socket or device with a text suffix is kept:
reading it fails with a message (`documents.open_document`) recorded as the document's error,
where skipping it would hide it and opening it could wait for ever.
"""

from __future__ import annotations

import os
from pathlib import Path

from qspec_core.errors import QspecError

TEXT_SUFFIXES = frozenset(
    {".txt", ".text", ".md", ".markdown", ".rst", ".org", ".tex", ".adoc", ".asciidoc", ".csv"}
)


def expand_inputs(paths: list[Path]) -> list[Path]:
    """The documents under `paths`, sorted by path; QspecError for a path that does not exist
    or a folder without any text file."""
    found: set[Path] = set()
    for path in paths:
        if not path.exists():
            raise QspecError(f"{path}: no such file or folder")
        if path.is_dir():
            files = _text_files(path)
            if not files:
                suffixes = ", ".join(sorted(TEXT_SUFFIXES))
                raise QspecError(f"{path}: no text files in this folder (looked for {suffixes})")
            found.update(files)
        else:
            found.add(path)
    return sorted(_one_path_per_file(found), key=lambda p: str(p))


def _one_path_per_file(paths: set[Path]) -> list[Path]:
    """One path for each file (`bw/doc1.txt` and `bw/../bw/doc1.txt`, or a link and its
    target, are one document): the file's own path where it was given, else the shortest."""
    by_file: dict[str, list[Path]] = {}
    for path in paths:
        by_file.setdefault(os.path.realpath(path), []).append(path)
    return [
        min(same, key=lambda p: (os.path.abspath(p) != real, len(str(p)), str(p)))
        for real, same in by_file.items()
    ]


def _text_files(folder: Path) -> list[Path]:
    files, seen = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # (a symlink loop, or a folder linked twice)
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(root) / name
            if name.startswith(".") or path.suffix.lower() not in TEXT_SUFFIXES:
                continue
            files.append(path)  # (a dangling link or a link loop: recorded as failed)
    return files
