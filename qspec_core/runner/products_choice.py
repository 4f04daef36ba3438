"""Which products the QuantSpec prefill's attention computes on a CPU, by measurement.

The tiled prefill kernel (`kernels/cpu/flash_prefill.h`) has three sets of products that
move the next-token law by less than the INT8 history the prefill reads already does
(docs/PERF.md: SmolLM2 at 7.5k, fp32 weights, mean KL against fp32 products: int16 2.6e-5,
bf16-values 3.1e-5, the INT8 history itself 4.8e-5):
- "fp32": every operand in fp32, every CPU;
- "int16": queries, keys, probabilities and values as 12- to 14-bit integer codes, exact
  integer sums (AVX512-VNNI builds);
- "bf16-values": fp32 scores, probabilities and values rounded to bf16 (AVX512-BF16 builds);
- "sdpa": the fp32 numbers on torch's own path (`scaled_dot_product_attention`), every build:
  the floor, so no CPU prefills slower than torch would (on an AVX2 build the tiled kernel's
  first form ran 15-30x slower than SDPA, docs/PERF.md).
("bf16", every operand in bf16, moves the law ten times as much: only when asked for.)
Which is fastest depends on the CPU: on Zen 4 int16 ran 1.5x fp32. So the first prefill on a
machine times each on a prefill chunk's attention and keeps the fastest in the qspec cache
(`prefill-attention.json`, `machine_choice`), keyed by CPU, torch version, the kernels' build
(its instruction set) and the products it has, so later runs on that machine compute the same
numbers.

`QSPEC_PREFILL_PRODUCTS=fp32|sdpa|int16|bf16-values|bf16` overrides the measurement (tests, or a
user who measured); products this build lacks run fp32. The full-precision cache (ar, the
original model) computes the fp32 numbers: on the faster of "fp32" and "sdpa" in the same
measurement (`exact_products`).
"""

from __future__ import annotations

from functools import lru_cache, partial

import torch

from kernels.cpu import attention as cpu_attention
from kernels.cpu import build as cpu_ext
from qspec_core.errors import QspecError
from qspec_core.machine_choice import (
    best_in_turns,
    cpu_description,
    machine_hash,
    measured_record,
)
from qspec_core.paths import qspec_home

CANDIDATES = ("fp32", "sdpa", "int16", "bf16-values")
EXACT = ("fp32", "sdpa")  # the fp32 numbers, on either path
ENV = cpu_attention.PRODUCTS_ENV
FILE = "prefill-attention.json"
# heads, KV heads, head size, chunk rows, history before the chunk: Qwen2.5-0.5B's heads, a
# 512-token chunk after 1.5k tokens (about 20 ms in fp32 on two Zen 4 cores)
PROBE = (14, 2, 64, 512, 1536)
# bumped when a candidate's kernel changes speed, so every machine measures again
VERSION = "flash-3"  # (2: 8-lane vectors on AVX2, SDPA a candidate; 3: int16 on AVX2)


def machine_key() -> str:
    """What the choice depends on: the CPU (model and flags), torch, the kernels' build (its
    instruction set: QSPEC_CPU_ISA=avx2 on an AVX-512 CPU times other code) and the products
    it computes. Not the thread count (runs at 1 and 2 threads must prefill alike)."""
    built = ",".join(cpu_attention.built_products())
    isa = cpu_ext.isa() if cpu_attention.available() else "none"
    return machine_hash(cpu_description(), f"torch {torch.__version__}", isa, built, VERSION)


def measure(shape: tuple[int, ...] = PROBE, repeats: int = 5) -> dict[str, float]:
    """Seconds per chunk attention of each candidate this build computes, at `shape`: the
    best of `repeats`, taken in turns (A B C A B C ...) so a busy moment slows all alike."""
    H, n_kv, D, T, start = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, T, D, generator=gen)
    k, v = (torch.randn(1, n_kv, start + T, D, generator=gen) for _ in range(2))
    names = [p for p in CANDIDATES if p in cpu_attention.built_products()]
    runs = {name: partial(cpu_attention.prefill_attention, q, k, v, start, name) for name in names}
    for run in runs.values():  # (warm-up: pages touched, the thread pool started)
        run()
    return best_in_turns(runs, repeats)


@lru_cache(maxsize=4)
def _measured_choice(key: str, home: str) -> dict:
    """{"path", "seconds"} for `key` in the qspec cache at `home`: kept there, else measured now
    (`machine_choice`)."""
    return measured_record(FILE, key, CANDIDATES, lambda: measure(), fallback="fp32")


def _record() -> dict:
    return _measured_choice(machine_key(), str(qspec_home()))


def override() -> str | None:
    """The products QSPEC_PREFILL_PRODUCTS forces, None for "auto" or unset; a QspecError for
    anything else (the CLI checks it before loading anything)."""
    try:
        return cpu_attention.asked_products()
    except cpu_ext.BuildSettingError as e:
        raise QspecError(str(e)) from None


def prefill_products() -> str:
    """The products of the QuantSpec prefill's attention on this machine (see the module
    doc); "fp32" without the C++ kernels (the reference computes in fp32)."""
    if not cpu_attention.available():
        return "fp32"
    forced = override()
    if forced is not None:
        return cpu_attention.prefill_products(forced)
    return _record()["path"]


def exact_products() -> str:
    """The faster path to the fp32 numbers (EXACT, in the same measurement as
    `prefill_products`): what the full-precision cache's prefill runs (QSPEC_PREFILL_PRODUCTS,
    where set, as for the QuantSpec prefill); "fp32" without the C++ kernels (the reference:
    SDPA)."""
    if not cpu_attention.available():
        return "fp32"
    forced = override()
    if forced is not None:
        return cpu_attention.prefill_products(forced)
    seconds = _record()["seconds"]
    timed = [p for p in EXACT if p in seconds]
    return min(timed, key=seconds.get) if timed else "fp32"
