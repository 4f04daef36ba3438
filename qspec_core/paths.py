"""Where qspec keeps converted models: $QSPEC_HOME, else $XDG_CACHE_HOME/qspec, else ~/.cache."""

from __future__ import annotations

import hashlib
import os
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
