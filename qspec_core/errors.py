"""User-facing errors: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

# a write refused for want of room: the disk is full, or the user's quota on it is spent
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class QspecError(Exception):
    """A problem the user can fix (bad input, missing model, offline registry, ...)."""


class UnsupportedModelError(QspecError):
    """The checkpoint uses an architecture or option this implementation does not run."""


def user_errors() -> tuple[type[Exception], ...]:
    """What the CLI reports as one `error:` line (exit code 2): ours, and the kernels' own
    settings errors (the kernels import nothing from here)."""
    from kernels.cpu.build import BuildSettingError

    return (QspecError, BuildSettingError)


def is_disk_full(error: BaseException) -> bool:
    """An OSError of a full disk or a spent quota (ENOSPC, EDQUOT)."""
    return isinstance(error, OSError) and error.errno in DISK_FULL


def _mount_point(path: Path) -> Path:
    """The mount point of the filesystem `path` is on (its nearest existing folder's)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    while not os.path.ismount(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def disk_full_error(path: str | os.PathLike, error: OSError) -> QspecError:
    """The user error for a write to `path` that failed with ENOSPC or EDQUOT: which disk
    (mount point) and how much room is left on it."""
    mount = _mount_point(Path(path))
    try:
        free = f", {shutil.disk_usage(mount).free / 2**20:,.1f} MiB free"
    except OSError:
        free = ""
    what = "the disk quota is used up" if error.errno == errno.EDQUOT else "the disk is full"
    return QspecError(
        f"cannot write {os.fsdecode(path)}: {what} ({error.strerror}; the filesystem mounted "
        f"at {mount}{free}); free some space and run again"
    )


@contextmanager
def disk_space(path: str | os.PathLike):
    """Writes under `path` inside this block: a full disk (ENOSPC, EDQUOT) becomes one user
    error naming the disk; any other OSError passes unchanged. The caller cleans up what it
    half wrote (its `finally`), as for any other failure."""
    try:
        yield
    except OSError as e:
        if e.errno in DISK_FULL:
            raise disk_full_error(path, e) from None
        raise
