"""The CPU fast path of the hierarchical-KV attention: `cpu_hier_attention.cpp`, built once.

Same arguments as `kernels.hier_attention.hier_attention` (the Triton kernel) and its PyTorch
twin `hier_attention_ref`, which the tests compare it against. The extension is compiled on
first use with the system C++ compiler (about a minute) into qspec's cache, per CPU (it is
built for the host's instruction set); if that fails, `available()` is False and the caller
keeps the reference path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_hier_attention.cpp")
DISABLE_ENV = "QSPEC_CPU_KERNELS"  # "0" turns the fast path off (the reference runs instead)
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
    digest = hashlib.sha256(SOURCE.read_bytes() + flags.encode() + torch.__version__.encode())
    return digest.hexdigest()[:12]


def _load():
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    from torch.utils.cpp_extension import load

    from qspec_core.paths import qspec_home

    name = f"qspec_cpu_attention_{_cpu_tag()}"
    build = qspec_home() / "build" / name
    build.mkdir(parents=True, exist_ok=True)
    try:
        _module = load(
            name=name,
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for's OpenMP backend lives in headers; without it, serial
            extra_cflags=[
                "-O3",
                "-march=native",
                "-ffast-math",
                "-fno-finite-math-only",
                "-fopenmp",
            ],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: the reference path still works
        _failed = f"{type(e).__name__}: {e}".splitlines()[0]
        warnings.warn(f"qspec: CPU attention kernel unavailable ({_failed})", stacklevel=2)
    return _module


def available() -> bool:
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    return _load() is not None


def hier_attention_cpu(
    q,
    k_upper,
    k_lower,
    k_scale,
    k_zero,
    v_upper,
    v_lower,
    v_scale,
    v_zero,
    n_quant_q,
    fp_k,
    fp_v,
    fp_pos0,
    fp_lo,
    input_pos,
    view,
    group_size,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Attention over one layer of the hierarchical cache (see `kernels/hier_attention.py` for
    the argument contract); returns [B, H, T, D] in q's dtype (a view of a [B, T, H, D]
    buffer: the output projection's transpose(1, 2).reshape is then free)."""
    module = _load()
    if module is None:
        raise RuntimeError(f"CPU attention kernel unavailable: {_failed}")
    # fp_k/fp_v: the cache's full-precision slice is read in place (strided, fp32)
    fp_k = (
        fp_k if fp_k.dtype == torch.float32 and fp_k.stride(-1) == 1 else fp_k.float().contiguous()
    )
    fp_v = (
        fp_v if fp_v.dtype == torch.float32 and fp_v.stride(-1) == 1 else fp_v.float().contiguous()
    )
    out = module.hier_attention_cpu(
        q,
        k_upper,
        k_lower,
        k_scale,
        k_zero,
        v_upper,
        v_lower,
        v_scale,
        v_zero,
        torch.as_tensor(n_quant_q),
        fp_k,
        fp_v,
        int(fp_pos0),
        torch.as_tensor(fp_lo),
        torch.as_tensor(input_pos),
        view == "target",
        int(group_size),
        int(chunk_size),
    )
    return out.to(q.dtype)
