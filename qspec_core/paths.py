"""Where qspec keeps converted models: $QSPEC_HOME, else $XDG_CACHE_HOME/qspec, else ~/.cache."""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path

from qspec_core.errors import QspecError

BUNDLED_TEXTS = Path(__file__).resolve().parent / "data"  # license texts: prompts, calibration


def qspec_home(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("QSPEC_HOME"):
        return Path(env["QSPEC_HOME"]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "qspec"


def models_dir(env: dict[str, str] | None = None) -> Path:
    return qspec_home(env) / "models"


def _home_source(env: dict[str, str]) -> str:
    """Which setting chose the cache folder, for an error message the user can act on."""
    if env.get("QSPEC_HOME"):
        return f"QSPEC_HOME={env['QSPEC_HOME']}"
    if env.get("XDG_CACHE_HOME"):
        return f"XDG_CACHE_HOME={env['XDG_CACHE_HOME']} (QSPEC_HOME is not set)"
    return "the default ~/.cache/qspec (neither QSPEC_HOME nor XDG_CACHE_HOME is set)"


def _folder_problem(folder: Path) -> str | None:
    """Why `folder` could not be made or written (None: it can), naming the part of its path
    at fault. Creates nothing."""
    for part in (folder, *folder.parents):
        try:
            if part.is_symlink() and not part.exists():  # (a loop also "does not exist")
                return f"{part} is a symbolic link to {os.readlink(part)}, which leads nowhere"
            if not part.exists():  # (also false below a file: ENOTDIR)
                continue
        except OSError as e:
            return f"{part}: {e.strerror or e}"
        if not part.is_dir():
            return f"{part} is not a folder"
        if not os.access(part, os.W_OK | os.X_OK):
            return f"{part} is not writable"
        try:  # os.access says yes to root, even in /proc or /sys: a real create does not lie
            os.rmdir(tempfile.mkdtemp(prefix=".qspec-probe-", dir=part))
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return f"{part} is not writable ({e.strerror})"
            return f"no folder can be made in {part} ({e.strerror})"
        return None
    return None


def check_home(env: dict[str, str] | None = None) -> None:
    """Refuse a qspec folder that cannot be used, before anything uses it. The CPU kernels
    build under it too: they read QSPEC_HOME themselves and only warn, so without this a bad
    one prints their warnings before the real error. Creates nothing."""
    env = os.environ if env is None else env
    home = qspec_home(env)
    for folder in (home, home / "models", home / "build"):  # (build: as kernels/cpu/build.py)
        problem = _folder_problem(folder)
        if problem is not None:
            raise QspecError(
                f"cannot use {folder}: {problem}; it comes from {_home_source(env)}: "
                "point QSPEC_HOME at a writable folder"
            )


def writable_models_dir(env: dict[str, str] | None = None) -> Path:
    """`models_dir()`, created if needed; a QspecError naming the variable that chose it when
    it cannot be used (a regular file on the way, no permission, a read-only file system)."""
    env = os.environ if env is None else env
    folder = models_dir(env)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(folder, os.W_OK | os.X_OK) else "not writable"
    except OSError as e:
        problem = e.strerror or str(e)
    if problem is not None:
        raise QspecError(
            f"cannot keep converted models in {folder} ({problem}): it comes from "
            f"{_home_source(env)}; point QSPEC_HOME at a writable folder"
        )
    return folder


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
