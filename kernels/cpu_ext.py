"""Builds qspec's C++ CPU kernels once, as one extension module, into qspec's cache.

Sources: `cpu_hier_attention.cpp` (attention over the hierarchical cache), `cpu_linear.cpp`
(x W^T for the few rows of a decode or verify step), `cpu_decode.cpp` (the small ops around
them: RMSNorm, RoPE, the int4 linear's casts), `cpu_step.cpp` (all decoder layers of a
decode step in one call) and `cpu_module.cpp` (the bindings). The build runs on first use
with the system C++ compiler (about two minutes), per source and per CPU (it is compiled for
the host's instruction set); if it fails, `available()` is False and every caller keeps its
PyTorch path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = tuple(
    HERE / n
    for n in (
        "cpu_hier_attention.cpp",
        "cpu_linear.cpp",
        "cpu_decode.cpp",
        "cpu_step.cpp",
        "cpu_module.cpp",
    )
)
HEADERS = (HERE / "cpu_kernels.h",)  # hashed with the sources, so an edit rebuilds
DISABLE_ENV = "QSPEC_CPU_KERNELS"  # "0" turns the C++ kernels off (the PyTorch paths run)
_module = None
_failed: str | None = None


def _cpu_tag() -> str:
    """Build per source and per CPU: -march=native code must not run on another CPU."""
    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    digest.update(flags.encode() + torch.__version__.encode())
    return digest.hexdigest()[:12]


def load():
    """The extension module, or None when it cannot be built here (warned once)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    from torch.utils.cpp_extension import load as build

    from qspec_core.paths import qspec_home

    name = f"qspec_cpu_{_cpu_tag()}"
    folder = qspec_home() / "build" / name
    folder.mkdir(parents=True, exist_ok=True)
    try:
        _module = build(
            name=name,
            sources=[str(p) for p in SOURCES],
            # -fopenmp: at::parallel_for's OpenMP backend lives in headers; without it, serial
            extra_cflags=[
                "-O3",
                "-march=native",
                "-ffast-math",
                "-fno-finite-math-only",
                "-fopenmp",
            ],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: the PyTorch paths still work
        _failed = f"{type(e).__name__}: {e}".splitlines()[0]
        warnings.warn(f"qspec: CPU kernels unavailable ({_failed})", stacklevel=2)
    return _module


def available() -> bool:
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    return load() is not None


def failure() -> str | None:
    """Why the build failed, if it did."""
    return _failed
