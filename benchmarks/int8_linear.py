"""One linear layer on CPU: fp32 vs bf16 dense vs INT8 (W8A16) vs the INT4 draft (W4A16).

Decode (M = 1) and a small verify block (M = 5) for the default model's shapes and one large
square layer. Variants run interleaved in rounds (so drift in machine load hits all of them
alike); the table shows the median per call and, in brackets, the fastest call: on a shared
machine the median can land on a scheduler time slice, the minimum is the kernel's own cost.
Activations are fp32 for every variant except bf16 dense, as in an fp32 model: Int8Linear and
Int4Linear cast to bf16 inside.

    python benchmarks/int8_linear.py [--rounds 7] [--iters 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear

SHAPES = [(576, 1536), (1536, 576), (576, 576), (4096, 4096)]  # (in_features, out_features)
GROUP_SIZE = 64  # the default draft's group for the default model (576 % 128 != 0)


@torch.inference_mode()
def time_calls(fn, x, iters: int) -> list[float]:
    fn(x)  # warm: first-call allocations and the int4 layout build stay out of the timing
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return times


def bench_shape(k: int, n: int, m: int, rounds: int, iters: int) -> dict[str, tuple]:
    """{variant: (median us, min us)} for x [m, k] through a [k -> n] layer."""
    torch.manual_seed(0)
    fp32 = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        fp32.weight.normal_(0.0, 0.02)
    bf16 = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(fp32.weight)
    int8 = Int8Linear.from_linear(fp32)
    int4 = Int4Linear.from_linear(fp32, GROUP_SIZE)
    assert int8.cpu_kernel_ok() and int4.cpu_kernel_ok(), "a variant would time its fallback"
    x = torch.randn(m, k)
    variants = {
        "fp32": (fp32, x),
        "bf16": (bf16, x.bfloat16()),
        "int8": (int8, x),
        "int4": (int4, x),
    }
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (layer, inp) in variants.items():
            samples[name] += time_calls(layer, inp, iters)
    return {name: (statistics.median(s) * 1e6, min(s) * 1e6) for name, s in samples.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__} · {torch.backends.cpu.get_cpu_capability()} · "
        f"{torch.get_num_threads()} threads · {args.rounds} rounds x {args.iters} calls, "
        "us/call: median [min]"
    )
    names = ("fp32 dense", "bf16 dense", "int8 W8A16", "int4 W4A16")
    print("weight MiB per layer, K x N -> " + ", ".join(names))
    for k, n in SHAPES:
        mib = [k * n * b / 2**20 for b in (4, 2, 1, 0.5)]  # int8/int4 scales not counted
        print(f"  {k}x{n}: " + ", ".join(f"{v:.2f}" for v in mib))
    header = f"{'K x N':>11s} {'M':>2s} " + " ".join(f"{name:>17s}" for name in names)
    print(header + "   int8/fp32 (median, min)")
    for k, n in SHAPES:
        for m in (1, 5):
            result = bench_shape(k, n, m, args.rounds, args.iters)
            cells = " ".join(f"{med:8.1f} [{low:6.1f}]" for med, low in result.values())
            fp32, int8 = result["fp32"], result["int8"]
            print(
                f"{k:>5d}x{n:<5d} {m:>2d} {cells}   "
                f"{fp32[0] / int8[0]:5.2f}x, {fp32[1] / int8[1]:5.2f}x"
            )


if __name__ == "__main__":
    main()
