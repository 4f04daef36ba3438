"""Where qspec keeps converted models: $QSPEC_HOME, else $XDG_CACHE_HOME/qspec, else ~/.cache."""

from __future__ import annotations

import os
from pathlib import Path


def qspec_home(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("QSPEC_HOME"):
        return Path(env["QSPEC_HOME"]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "qspec"


def models_dir(env: dict[str, str] | None = None) -> Path:
    return qspec_home(env) / "models"
