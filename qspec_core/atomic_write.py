"""Write one output file atomically, never clobbering what the user did not ask to replace.

The bytes go to a temporary sibling `.{name}.{host}.{pid}.{random}.tmp` (fsynced), which is
then published: without `force` by a hard link, which fails if the name exists (so of two
writers racing for the same output exactly one wins, the other gets "exists"); with `force`
by `os.replace`. The folder is fsynced after publishing. Only a regular file, or a symlink to
one (the link itself is replaced, its target is left alone), may be overwritten: a device,
FIFO, socket, folder or dangling link never is.

A writer killed with -9 leaves its temporary file behind; its name carries the host and pid,
so the next write of the same output (or `check_output`) removes it once that process is
gone, and never touches a live writer's file.

Where the filesystem has no hard links (FAT, some network and FUSE mounts) the name is
reserved with O_CREAT|O_EXCL and the temporary file renamed over the reservation: still
exactly one winner, but for that instant the output exists and is empty.

Residual race, documented rather than solved: with `force`, something swapped in between the
type check and the rename (microseconds) is replaced.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from qspec_core.errors import QspecError, disk_full_error, is_disk_full

# errnos of a link(2) the filesystem does not offer (as opposed to "the name exists")
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOSYS, errno.EOPNOTSUPP}
_NO_HARD_LINKS |= {errno.ENOTSUP}  # the same number as EOPNOTSUPP on Linux, not everywhere
_STEM_MAX = 128  # of the output name inside a temporary name: stay under NAME_MAX (255)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def temp_path(path: Path) -> Path:
    """A fresh temporary name for `path` that says which live process owns it."""
    stem = path.name[:_STEM_MAX]
    return path.parent / f".{stem}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or a pid we cannot ask about: keep its file
    return True


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove temporary files of `path` left by dead writers on this host; return them."""
    pattern = re.compile(
        re.escape(f".{path.name[:_STEM_MAX]}.{_host()}.") + r"(\d{1,10})\.[0-9a-f]{8}\.tmp"
    )
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed  # no folder yet (or unreadable): nothing of ours to clean
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and int(match[1]) > 0 and not _alive(int(match[1])):
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except FileNotFoundError:
                pass  # another writer cleaned it first
            except OSError:
                pass  # not ours to fight over; the write itself reports real problems
    return removed


def _file_in_the_way(path: Path) -> Path | str:
    """The nearest existing parent of `path` that is not a folder (what ENOTDIR was about)."""
    for parent in path.parents:
        if parent.exists():
            return parent if not parent.is_dir() else "a parent of it"
    return "a parent of it"


def check_target(path: Path, force: bool) -> None:
    """Refuse an output that exists (without force) or that is not a regular file."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise QspecError(f"{path}: {_file_in_the_way(path)} is a file, not a folder") from None
    except OSError as e:
        raise QspecError(f"{path}: cannot inspect ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise QspecError(f"{path} is a folder; give a file name")
    if stat.S_ISLNK(st.st_mode):
        try:
            st = path.stat()
        except OSError:
            raise QspecError(f"{path} is a symlink to nothing; refusing to replace it") from None
        if not stat.S_ISREG(st.st_mode):
            raise QspecError(f"{path} is a symlink to something other than a regular file")
    elif not stat.S_ISREG(st.st_mode):
        raise QspecError(f"{path} is not a regular file (a device, FIFO or socket)")
    if not force:
        raise QspecError(f"{path} exists; pass --force to overwrite it")


def _existing_ancestor(folder: Path) -> Path:
    """The deepest existing folder on the way to `folder`; QspecError if a file is in the way."""
    probe = folder
    while True:
        try:
            st = probe.stat()
        except FileNotFoundError:
            probe = probe.parent
            continue
        except NotADirectoryError:
            blocker = _file_in_the_way(folder)
            raise QspecError(f"{folder}: {blocker} is a file, not a folder") from None
        except OSError as e:
            raise QspecError(f"{folder}: cannot inspect ({e.strerror})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise QspecError(f"{folder}: {probe} is a file, not a folder")
        return probe


def _probe_writable(path: Path) -> None:
    """Create and remove a real file (or folder) where the output will go: os.access lies
    for root and on network filesystems, an actual create does not."""
    folder = path.parent
    base = _existing_ancestor(folder)
    try:
        if base == folder:
            trial = temp_path(path)  # named like a temp file: a kill -9 here is cleaned up
            os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            trial.unlink()
        else:  # the folder will be created: check that a folder can be made there
            trial = base / f".{path.name[:_STEM_MAX]}.{secrets.token_hex(4)}.mkdir"
            trial.mkdir()
            trial.rmdir()
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(path, e) from None
        raise QspecError(f"cannot write {path}: {_create_failure(folder, base, e)}") from None


def _create_failure(folder: Path, base: Path, e: OSError) -> str:
    """What a failed trial create says, true to its errno: only a refusal is "not writable";
    /proc, say, refuses a new file with ENOENT in a folder that plainly exists."""
    if base != folder:
        return f"folder {folder} cannot be created in {base} ({e.strerror})"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{folder} is not writable ({e.strerror})"
    return f"no new file can be made in {folder} ({e.strerror})"


def check_output(path: Path, force: bool, need_bytes: int | None = None) -> None:
    """Raise QspecError now if `path` could not be written later (call before long work).

    Checks: exists without `force`; exists and is not a regular file (or a link to one); a
    parent is a file; the folder is not writable or cannot be created; fewer than
    `need_bytes` free bytes where it goes. Removes dead writers' temporary files of `path`.
    Creates nothing that stays.
    """
    path = Path(path)
    check_target(path, force=True)  # a folder, a device, a dangling link: never replaced
    _probe_writable(path)  # before "exists": --force would not help a folder we cannot write
    check_target(path, force)
    remove_stale_temps(path)
    if need_bytes is not None:
        base = _existing_ancestor(path.parent)
        free = shutil.disk_usage(base).free
        if free < need_bytes:
            raise QspecError(
                f"{base}: {free / 2**20:,.1f} MiB free, the output needs about "
                f"{need_bytes / 2**20:,.1f} MiB; free some space or write elsewhere"
            )


def check_output_file(path: Path, option: str) -> None:
    """`check_output` of a file an option names, replaced if it exists (`--json`, `--plot`),
    its message prefixed with the option: before the work that produces it. Its folder must
    exist (a typo in it is refused, not created)."""
    path = Path(path)
    try:
        check_target(path, force=True)
        if _existing_ancestor(path.parent) != path.parent:
            raise QspecError(f"{path}: folder {path.parent} does not exist")
        check_output(path, force=True)
    except QspecError as e:
        raise QspecError(f"{option}: {e}") from None


def _fsync_folder(folder: Path) -> None:
    """Make the new name durable. Best effort: the file's bytes are already fsynced and
    published, and some filesystems cannot fsync a folder at all (EINVAL)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _publish_exclusive(tmp: Path, path: Path) -> None:
    """Give `tmp` the name `path` only if nothing has that name: exactly one racer wins."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise QspecError(f"{path} exists; pass --force to overwrite it") from None
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
    try:  # no hard links here: reserve the name, then rename over the reservation
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise QspecError(f"{path} exists; pass --force to overwrite it") from None
    reserved = os.fstat(fd)
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _release(path, reserved)
        raise


def _release(path: Path, reserved: os.stat_result) -> None:
    """Remove `path` if it is still the empty reservation we made (not someone's file)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == (reserved.st_dev, reserved.st_ino):
            os.unlink(path)
    except OSError:
        pass


def write_atomic(path: Path, write: Callable[[BinaryIO], None], force: bool) -> None:
    """Call `write(f)` on a temporary file and publish it as `path`, or leave nothing.

    QspecError for every problem the user can fix (exists, not a regular file, no space,
    no permission); the temporary file is removed on any failure, Ctrl-C included.
    """
    path = Path(path)
    check_target(path, force)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise QspecError(f"{path}: {_file_in_the_way(path)} is a file, not a folder") from None
    except OSError as e:
        raise QspecError(f"{path.parent} cannot be created ({e.strerror})") from None
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if force:
            check_target(path, True)  # again, just before the rename: narrow the race
            os.replace(tmp, path)
        else:
            _publish_exclusive(tmp, path)
        _fsync_folder(path.parent)
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(path, e) from None
        raise QspecError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # renamed into place, or never created
