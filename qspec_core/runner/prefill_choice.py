"""Which CPU path runs an INT8-weight layer's many-row products (a prefill), by measurement.

Three paths compute x W^T for W = q * scale (per output channel), x [M, K] with M in the
hundreds:
- "rows": qspec's own kernels (`kernels/cpu/linear.py`: `w8a8_linear` for the W8A8 target,
  all rows in one call as a GEMM, `kernels/cpu/int_gemm.h`: with AVX-512 VNNI each chunk's
  integer dot in one lane, a decode step's result to fp32 rounding, else the step's blocks
  and bits; `int8_linear` for W8A16, `SLICE_ROWS` rows a call, a decode step's bits). Each
  row's result is independent of the other rows. Only where the C++ kernels run;
- "int8pack": torch's int8 weight kernel `torch._weight_int8pack_mm`, fast only with bf16
  activations: x is rounded to bf16 and the sum to bf16 (`quant/int8.py` bounds the error);
- "fp32": W dequantized to fp32, then torch's fp32 GEMM: fp32 rounding only.
Which is faster depends on the CPU, not on a flag it lists: on an Intel Xeon with AVX512-BF16
the bf16 path prefilled at 0.62-0.69x the fp32 path; on a Zen 5 EPYC it was the faster one
(shared/facts.md); on one Zen 4 thread the row kernels ran 1.5-2.5x the bf16 one. So the
first many-row product on a machine times each on a prefill-sized W8A8 product and keeps the
fastest, written to the qspec cache (`int8-prefill.json`, keyed by CPU, torch version
and whether the C++ kernels run) so later runs on that machine compute the same
numbers: greedy output stays reproducible from run to run (README).

`QSPEC_INT8_PREFILL=rows|int8pack|fp32` overrides the measurement (tests, or a user who
measured); "rows" without the C++ kernels runs int8pack.
Fewer rows than `PREFILL_ROWS` (decode, verify without the C++ kernels) always take int8pack:
dequantizing W for one row would read 9 bytes a weight instead of one.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from kernels.cpu import build as cpu_ext
from kernels.cpu import linear as cpu_linear
from kernels.formats import quantize_activations
from qspec_core.errors import QspecError
from qspec_core.machine_choice import (
    best_in_turns,
    cpu_description,
    machine_hash,
    measured_choice,
)
from qspec_core.paths import qspec_home

PATHS = ("rows", "int8pack", "fp32")
ENV = "QSPEC_INT8_PREFILL"
PREFILL_ROWS = 64  # from here on a product is a prefill's (decode and verify stay under it)
PROBE = (256, 1024, 1024)  # M, K, N: a prefill chunk's rows through a mid-sized linear
FILE = "int8-prefill.json"
# bumped when the "rows" path's speed changes (2: W8A8 on a GEMM schedule; 3: with AVX-512
# VNNI, the lane-per-chunk GEMM of int_gemm.h; 4: it on AVX2 and AVX-VNNI too), so every machine
# measures again rather than
# keep a choice made against the old kernels
ROWS_VERSION = "rows-gemm-4"


def _rows_run() -> bool:
    return cpu_ext.available()  # (False with QSPEC_CPU_KERNELS=0 or a failed build)


def machine_key() -> str:
    """What the choice depends on: the CPU (model and flags), torch, and which build of qspec's
    C++ kernels runs, if any (the "rows" path: its instruction set). Not the thread count: runs
    at 1 and 2 threads must prefill alike for their greedy output to agree (README,
    reproducibility)."""
    rows = f"rows {cpu_ext.isa()}" if _rows_run() else "rows False"  # (the build's ISA too)
    return machine_hash(cpu_description(), f"torch {torch.__version__}", rows, ROWS_VERSION)


def _products(m: int, k: int, n: int):
    """Each path's W8A8 product of [m, k] activations (rounded per 64 inputs, as the W8A8
    target's are) by int8 [n, k] weights, as the prefill runs it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) / 127
    ones = torch.ones(n, dtype=torch.bfloat16)
    paths = {
        "int8pack": lambda: (
            torch._weight_int8pack_mm(quantize_activations(x).to(torch.bfloat16), q, ones) * scale
        ),
        "fp32": lambda: quantize_activations(x) @ (q.float() * scale[:, None]).t(),
    }
    if _rows_run():
        paths["rows"] = lambda: cpu_linear.w8a8_linear(x, q, scale, None)
    return paths


def measure(shape: tuple[int, int, int] = PROBE, repeats: int = 5) -> dict[str, float]:
    """Seconds per product of each path at `shape`: the best of `repeats`, taken in turns
    (A B C A B C ...) so a busy moment slows every path alike; a path this torch cannot run
    here is left out."""
    runs = {}
    for name, run in _products(*shape).items():
        try:
            run()  # (warm-up: oneDNN picks its kernel, pages are touched)
        except RuntimeError:
            continue
        runs[name] = run
    return best_in_turns(runs, repeats)


@lru_cache(maxsize=4)
def _measured_choice(key: str, home: str) -> str:
    """The path for `key`: kept in the qspec cache at `home`, else measured now
    (`machine_choice`)."""
    return measured_choice(FILE, key, PATHS, lambda: measure(), fallback="fp32")


def override() -> str | None:
    """The path QSPEC_INT8_PREFILL forces, None for "auto" or unset; a QspecError for anything
    else (the CLI checks it before loading anything)."""
    value = os.environ.get(ENV, "")
    forced = value.strip().lower()
    if forced in PATHS:
        return forced
    if forced not in ("", "auto"):
        raise QspecError(f"{ENV}={value!r}: expected auto, {' or '.join(PATHS)}")
    return None


def prefill_path() -> str:
    """The path many-row INT8-weight products take on this machine (`PATHS`)."""
    path = override() or _measured_choice(machine_key(), str(qspec_home()))
    return "int8pack" if path == "rows" and not _rows_run() else path
