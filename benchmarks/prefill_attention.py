"""A prefill chunk's causal attention on CPU (`kernels/cpu/flash_prefill.h`) after a history
of S tokens: GFLOP/s of the tiled kernel per history length and product type, the rate the
bench's "attention GFLOP/s" column reports for a whole prefill.

    python benchmarks/prefill_attention.py --history 8192,32256 [--heads 14 --kv-heads 2]
        [--products fp32,sdpa,bf16,bf16-values,int16] [--window W] [--softcap C] [--json out.json]

Shapes default to Qwen2.5-0.5B's (14 query heads, 2 kv heads, head_dim 64; SmolLM2: 9, 3) and
a chunk of 512 rows, the prefill's. Products run interleaved in rounds, so drift of the
machine hits them alike; the figure is each one's fastest call (the kernel's own cost on a
shared machine). FLOPs as the bench counts them (`qspec_core.bench.compute.attention_flops`,
a local layer's over its `--window`). "sdpa" is torch's path (`kernels.reference.
causal_attention`); with `--softcap` (Gemma 2's 50) that is the written-out capped attention,
which every capped chunk ran before the tiled kernel took the cap. bf16 products need a build
with AVX512-BF16, int16 products one with AVX2.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kernels.cpu import attention as cpu_attention
from qspec_core.bench.compute import attention_flops


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    products = args.products.split(",")
    for p in products:
        os.environ[cpu_attention.PRODUCTS_ENV] = p
        if cpu_attention.prefill_products() != p:  # (raises on an unknown name)
            raise ValueError(f"products {p!r} need AVX512-BF16 (bf16) or AVX2 (int16)")
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window is a positive number of keys, not {args.window}")
    if args.softcap is not None and not args.softcap > 0:
        raise ValueError(f"--softcap is positive, not {args.softcap}")
    rows = []
    for start in (int(s) for s in args.history.split(",")):
        S = start + args.rows
        q = torch.randn(1, args.heads, args.rows, args.dim, generator=gen)
        k = torch.randn(1, args.kv_heads, S, args.dim, generator=gen)
        v = torch.randn(1, args.kv_heads, S, args.dim, generator=gen)
        best = dict.fromkeys(products, float("inf"))
        for _ in range(args.rounds):
            for p in products:
                os.environ[cpu_attention.PRODUCTS_ENV] = p
                t0 = time.perf_counter()
                cpu_attention.prefill_attention(q, k, v, start, None, args.window, args.softcap)
                best[p] = min(best[p], time.perf_counter() - t0)
        for p in products:
            flops = attention_flops(args.dim, args.heads, args.rows, start, args.window)
            rate = flops / best[p] / 1e9
            rows.append({"history": start, "products": p, "ms": best[p] * 1e3, "gflops": rate})
            print(f"history {start:>6}  {p:<11}  {best[p] * 1e3:8.1f} ms  {rate:6.0f} GFLOP/s")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--history", default="2048,8192,16384,32256", help="keys before the chunk")
    p.add_argument("--rows", type=int, default=512, help="the chunk's query rows")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--products", default="fp32")
    p.add_argument("--window", type=int, help="a local layer's sliding window (default: none)")
    p.add_argument("--softcap", type=float, help="Gemma 2's cap of the scores (default: none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json")
    args = p.parse_args()
    try:
        rows = run(args)
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    if args.json:
        with open(args.json, "w") as f:
            config = {k: v for k, v in vars(args).items() if k != "json"}
            json.dump({"config": config, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
