"""One decode step: 4-bit draft weights vs the target weights, side by side in one run.

Short context (the weights dominate), full-precision KV for every variant, interleaved
repeats, medians. Variants: target weights in fp32 and bf16, draft (W4A16) weights.

    python benchmarks/draft_step.py --model DIR_FROM_QSPEC_CONVERT --context 256 --steps 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.convert.folder import load_converted
from qspec_core.engine.generate import prefill
from qspec_core.precision import DRAFT_W4, FP
from qspec_core.runner import build_runner


@torch.inference_mode()
def step_times(model, path, context, steps):
    cache = FullPrecisionCache(model.config, context + steps + 1, dtype=model.dtype)
    prefill(model, cache, list(range(100, 100 + context)), 0, path)
    times = []
    tok = torch.tensor([[42]])
    for i in range(steps):
        t0 = time.perf_counter()
        model(tok, torch.tensor([context + i]), cache, path)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a folder from qspec convert")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    models = {
        "fp32": build_runner(load_converted(args.model, torch.float32)),
        "bf16": build_runner(load_converted(args.model, torch.bfloat16)),
    }
    variants = {
        "target-fp32": ("fp32", FP),
        "target-bf16": ("bf16", FP),
        "draft-w4a16": ("fp32", DRAFT_W4),  # 4-bit weights, full-precision KV like the others
    }
    samples = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (dtype, path) in variants.items():
            samples[name] += step_times(models[dtype], path, args.context, args.steps)
    result = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    for name, ms in result.items():
        print(
            f"{name:12s} {ms:8.2f} ms/step   ({result['target-fp32'] / ms:.2f}x vs target-fp32,"
            f" {result['target-bf16'] / ms:.2f}x vs target-bf16)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "context": args.context,
                    "ms_per_step": result,
                    "threads": torch.get_num_threads(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
