"""Where a decode step's time goes: torch.profiler over `ar` and `quantspec` decoding.

For each mode: prefill the bench prompt (not profiled), then decode `--gen` tokens under the
profiler and report, per op, its self time as a share of the decode's wall time, and what is
left outside every op (Python, module dispatch, the profiler's own cost). qspec's C++ CPU
kernels (attention, the few-row and W4A8 linears, norms, RoPE) are not torch ops, so they are
wrapped here to show up as `qspec::<name>`. Each mode first decodes a few tokens as a
discarded warm-up
(lazy weight packing, allocator growth). The profiler adds overhead per op, so shares of
many small ops read high: use it to rank, and `qspec bench` for speed.

    python benchmarks/step_profile.py --context 8k --gen 32 --json docs/profile-8k.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kernels.cpu import build as cpu_ext
from qspec_core.bench.corpus import bench_prompt
from qspec_core.bench.runner import BenchConfig, parse_contexts, start_decode
from qspec_core.registry.runtime import prepare_and_load
from qspec_core.timing import StageTimer


class _Labelled:
    """qspec's C++ extension with every function wrapped in a profiler label, so that its
    kernels show up as `qspec::<name>` instead of as time outside every op."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        fn = getattr(self._module, name)

        def wrapped(*args, **kwargs):
            with record_function(f"qspec::{name}"):
                return fn(*args, **kwargs)

        return wrapped


if cpu_ext.load() is not None:
    cpu_ext._module = _Labelled(cpu_ext.load())


@torch.inference_mode()
def profile_mode(rt, mode_name: str, prompt: list[int], gen: int, gamma: int, top: int) -> dict:
    config = BenchConfig(contexts=[len(prompt) + gen], gen=gen, gamma=gamma)
    timer = StageTimer()
    _, tokens, stats = start_decode(rt.runner, mode_name, prompt, gen, config, 0, timer)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        n = sum(1 for _ in tokens)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "mode": mode_name,
        "prompt_tokens": len(prompt),
        "new_tokens": n,
        "wall_s": wall,
        "stages_s": {k: v for k, v in timer.seconds.items() if not k.startswith("prefill")},
        "rounds": stats.rounds if stats is not None else None,
        "in_ops_share": in_ops / wall,
        "outside_ops_share": max(0.0, 1 - in_ops / wall),
        "ops": [
            {
                "op": e.key,
                "calls": e.count,
                "self_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / 1e6 / wall,
            }
            for e in ranked
        ],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="default: qspec's default model")
    ap.add_argument("--context", default="8k")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--modes", default="ar,quantspec")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rt = prepare_and_load(args.model, dtype="fp32", need_draft=True)
    out = []
    for context in parse_contexts(args.context):
        prompt = bench_prompt(rt.tokenizer, context - args.gen)
        for mode in args.modes.split(","):
            profile_mode(rt, mode, prompt[:256], 8, args.gamma, args.top)  # warm-up
            r = profile_mode(rt, mode, prompt, args.gen, args.gamma, args.top)
            out.append(r)
            steps = r["rounds"] or r["new_tokens"]
            print(
                f"\n{mode} at {len(prompt)} prompt tokens: {r['new_tokens']} tokens in "
                f"{r['wall_s']:.2f} s ({1000 * r['wall_s'] / steps:.1f} ms per "
                f"{'round' if r['rounds'] else 'step'}); outside ops "
                f"{r['outside_ops_share']:.0%}"
            )
            for stage, s in r["stages_s"].items():
                print(f"  stage {stage:<10} {s:7.3f} s")
            for op in r["ops"]:
                print(f"  {op['share']:6.1%} {op['self_s']:7.3f} s {op['calls']:6d}x  {op['op']}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "runs": out}, indent=2))


if __name__ == "__main__":
    main()
