"""One `ar` step, one draft step and one verify step at a given context, side by side.

Prefills the context once (a full-precision forward of the default model, or `--model`),
loads the same KV into a hierarchical cache, then times single forwards, interleaved and
rolled back after each: `ar` (full weights, fp32 KV, one token), `draft` (4-bit weights, INT4
view, one token) and `verify` (full weights, INT8 view, gamma + 1 tokens). `--compare` adds
the same steps with one of qspec's C++ CPU paths switched off, in the same run:
`linear` (the few-row fp32 linear -> F.linear), `w4a8` (the W4A8 draft linear -> PyTorch's
int4 kernel with bf16 activations) and `stack` (all layers in one C++ call -> the Python layer
loop; `linear` and `w4a8` switch the stack off too, since it calls those kernels itself).
Medians of `--repeats`; the estimate is
tokens_per_round * ar / (gamma * draft + verify), with tokens_per_round from `qspec bench`.

    python benchmarks/decode_steps.py --context 8192 --compare linear,w4a8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.cpu import linear as cpu_linear
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.generate import prefill
from qspec_core.precision import DRAFT, FP, TARGET
from qspec_core.registry.runtime import prepare_and_load

# --compare name -> the gates that, answering False (None), switch the C++ path off; "stack"
# stands for the runner's `stack` (then the model's layer loop runs, with the runner's ops)
STACK = "stack"
SWITCHES = {
    "linear": [(cpu_linear, "usable"), STACK],
    "w4a8": [(cpu_linear, "int4_usable"), STACK],
    "stack": [STACK],
}


def _without(gates: list, fn, runner):
    """fn with gates forced off (the paths below them run instead)."""
    gates = [(runner, "stack") if gate == STACK else gate for gate in gates]

    def run():
        real = [getattr(owner, name) for owner, name in gates]
        for gate in gates:
            off = None if gate[0] is runner else False
            setattr(*gate, lambda *a, off=off, **k: off)
        try:
            fn()
        finally:
            for (owner, name), fn_real in zip(gates, real, strict=True):
                setattr(owner, name, fn_real)

    return run


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="default: qspec's default model (with its draft)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--compare", default="", help="comma-separated: " + ",".join(SWITCHES))
    ap.add_argument("--tokens-per-round", type=float, default=None, help="for the estimate")
    ap.add_argument("--json")
    a = ap.parse_args()
    rt = prepare_and_load(a.model, dtype="fp32", need_draft=True, log=lambda *_: None)
    model, runner, ctx = rt.model, rt.runner, a.context
    ids = list(range(1000, 1000 + ctx))  # token ids only set the KV; any ids will do
    fp = FullPrecisionCache(model.config, ctx + a.gamma + 2, dtype=torch.float32)
    prefill(runner, fp, ids, 0, FP)
    hc = HierarchicalKVCache(model.config, ctx + a.gamma + 2, dtype=torch.float32)
    hc.load_full_precision(fp.k[:, :, :, :ctx], fp.v[:, :, :, :ctx])
    one, pos1 = torch.tensor([[42]]), torch.tensor([ctx])
    many, pos_many = torch.tensor([[42] * (a.gamma + 1)]), torch.arange(ctx, ctx + a.gamma + 1)

    def step(tokens, pos, cache, path):
        def run():
            runner(tokens, pos, cache, path)
            cache.truncate(ctx)

        return run

    steps = {
        "ar": step(one, pos1, fp, FP),
        "draft": step(one, pos1, hc, DRAFT),
        "verify": step(many, pos_many, hc, TARGET),
    }
    for name in filter(None, a.compare.split(",")):
        if name not in SWITCHES:
            raise SystemExit(f"--compare takes {', '.join(SWITCHES)}, not {name!r}")
        for base in ("ar", "draft", "verify"):
            steps[f"{base} without {name}"] = _without(SWITCHES[name], steps[base], runner)
    for fn in steps.values():  # warm up: lazy layouts, allocator
        fn()
    times = {name: [] for name in steps}
    for _ in range(a.repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"context {ctx}, gamma {a.gamma}, {torch.get_num_threads()} threads, "
          f"medians of {a.repeats} interleaved repeats (ms per forward)")  # fmt: skip
    for name, v in ms.items():
        print(f"  {name:28s} {v:8.1f}")
    result = {"context": ctx, "gamma": a.gamma, "repeats": a.repeats, "ms": ms}
    result["ar_over_draft"] = ms["ar"] / ms["draft"]
    if a.tokens_per_round:
        round_ms = a.gamma * ms["draft"] + ms["verify"]
        result["estimated_speedup"] = a.tokens_per_round * ms["ar"] / round_ms
        print(f"  estimate at {a.tokens_per_round} tokens per round: "
              f"{result['estimated_speedup']:.2f}x ar")  # fmt: skip
    print(f"  ar / draft: {result['ar_over_draft']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       **result}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
