"""One `ar` step, one draft step and one verify step at a given context, side by side.

Prefills the context once (a full-precision forward of the default model, or `--model`),
loads the same KV into a hierarchical cache, then times single forwards, interleaved and
rolled back after each: `ar` (the target weights, fp32 KV, one token), `target-ar` (the
target weights over the INT8 view, one token: the step QuantSpec's draft must undercut),
`draft` (4-bit weights, INT4 view, one token, scoring the vocabulary slice decoding gives it,
`engine/draft_vocab.py`; beside it the same step scoring the whole head) and `verify` (the
target weights, INT8 view, gamma + 1 tokens); the context is the bench's prompt
(`bench/corpus.py`); `--target-weights` as qspec's (auto: w8a8 on a CPU), and with `--full`
also `ar full` on the checkpoint's own weights (bf16-held where the kernels read bf16:
`kernel_table.holds_bf16`). Each step's bytes read (weights of its path + its view's KV)
over its time, as a share of the read bandwidth measured in the same run
(`qspec_core/bench/bandwidth.py`), and the draft/target step-cost ratio. `--compare` adds
the same steps with one of qspec's C++ CPU paths switched off, in the same run: `linear` (the
few-row fp32 linear -> F.linear), `w4a8` (the W4A8 draft linear -> PyTorch's int4 kernel
with bf16 activations) and `stack` (all layers in one C++ call -> the Python layer loop;
`linear` and `w4a8` switch the stack off too, since it calls those kernels itself). Medians
of `--repeats`; the estimate is tokens_per_round * ar / (gamma * draft + verify), with
tokens_per_round from `qspec bench`. The read bandwidth is probed in every repeat, beside its
steps, and a step's share is the median of its repeats' shares, each against its own
repeat's probe: on a shared machine the bandwidth drifts within a run (31-65 GB/s between
runs minutes apart on 2 Zen 4 cores, 2026-12-07), and one probe at the start put the same
step at 60% in one run and 82% in the next.

    python benchmarks/decode_steps.py --context 8192 --compare linear,w4a8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.cpu import linear as cpu_linear
from qspec_core.bench.bandwidth import (
    kv_read_positions,
    path_weight_bytes,
    probe_buffer,
    read_bandwidth,
)
from qspec_core.bench.corpus import bench_prompt
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.draft_vocab import DraftVocab
from qspec_core.engine.generate import prefill, prefill_hierarchical
from qspec_core.precision import DRAFT, FP, TARGET
from qspec_core.registry.runtime import prepare_and_load

# --compare name -> the gates that, answering False (None), switch the C++ path off; "stack"
# stands for the runner's `stack` (then the model's layer loop runs, with the runner's ops)
STACK = "stack"
WHOLE_HEAD = "draft, whole head"  # the draft step without its vocabulary slice
PROBE_READS = 2  # timed reads of the bandwidth probe per repeat (its best)
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
    ap.add_argument("--target-weights", default="auto", help="auto, full, int8, w8a8")
    ap.add_argument("--full", action="store_true",
                    help="also `ar` on the full weights (else they are not read)")  # fmt: skip
    ap.add_argument("--json")
    a = ap.parse_args()
    rt = prepare_and_load(a.model, dtype="fp32", need_draft=True, log=lambda *_: None,
                          target_weights=a.target_weights, full_weights=a.full)  # fmt: skip
    model, runner = rt.model, rt.runner
    weights = rt.target_weights
    # the bench's prompt: its ids set the KV and the draft's vocabulary slice, as a document's
    ids = bench_prompt(rt.tokenizer, a.context)
    ctx = len(ids)
    vocab = DraftVocab.build(model, ids, DRAFT)  # (None: a head that is not sliced)
    fp = FullPrecisionCache(model.config, ctx + a.gamma + 2, dtype=torch.float32)
    prefill(runner, fp, ids, 0, FP.with_weights(weights))
    hc = HierarchicalKVCache(model.config, ctx + a.gamma + 2, dtype=torch.float32)
    if fp.window is None:  # (the same KV, quantized: no second prefill)
        hc.load_full_precision(fp.k[:, :, :, :ctx], fp.v[:, :, :, :ctx])
    else:  # (a local layer's full-precision keys are only a window's worth: its own prefill)
        prefill_hierarchical(runner, hc, ids, weights=weights)
    one, pos1 = torch.tensor([[42]]), torch.tensor([ctx])
    many, pos_many = torch.tensor([[42] * (a.gamma + 1)]), torch.arange(ctx, ctx + a.gamma + 1)

    def step(tokens, pos, cache, path, head=None):
        def run():
            runner(tokens, pos, cache, path, head=head)
            cache.truncate(ctx)

        return run

    paths = {
        "ar": FP.with_weights(weights),
        "target-ar": TARGET.with_weights(weights),
        "draft": DRAFT,
        "verify": TARGET.with_weights(weights),
    }
    if vocab is not None:
        paths[WHOLE_HEAD] = DRAFT
    if a.full:
        paths["ar full"] = FP
    heads = {"draft": vocab.head if vocab is not None else None}
    steps = {
        name: step(many if name == "verify" else one, pos_many if name == "verify" else pos1,
                   fp if path.kv == "fp" else hc, path, heads.get(name))
        for name, path in paths.items()
    }  # fmt: skip
    for name in filter(None, a.compare.split(",")):
        if name not in SWITCHES:
            raise SystemExit(f"--compare takes {', '.join(SWITCHES)}, not {name!r}")
        for base in list(paths):
            steps[f"{base} without {name}"] = _without(SWITCHES[name], steps[base], runner)
    for fn in steps.values():  # warm up: lazy layouts, allocator
        fn()
    probe = probe_buffer()
    layouts = getattr(runner, "layouts", None)
    fp_per_token = fp.bytes_per_token()
    history = kv_read_positions(ctx, model.config.windows)  # (per layer, on average)
    rows = {"draft": len(vocab.ids)} if vocab is not None else {}
    read = {  # bytes a step reads: its path's weights (the draft: its head's slice), its KV
        name: path_weight_bytes(model, path.weights, layouts, rows.get(name))
        + history * (fp_per_token if path.kv == "fp" else hc.bytes_per_token(path.kv))
        for name, path in paths.items()
    }
    times = {name: [] for name in steps}
    probes = []  # each repeat's read bandwidth, bytes/s
    for _ in range(a.repeats):
        probes.append(read_bandwidth(repeats=PROBE_READS, buf=probe))
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    del probe
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    bandwidth = statistics.median(probes)
    head = model.lm_head.out_features
    print(f"context {ctx}, gamma {a.gamma}, {torch.get_num_threads()} threads, target weights "
          f"{weights}, medians of {a.repeats} interleaved repeats; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s ({min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f}, "
          f"probed in each repeat); the draft scores {rows.get('draft', head):,} of "
          f"{head:,} vocabulary rows")  # fmt: skip
    print(f"  {'step':28s} {'ms':>8s} {'MB read':>9s} {'of bandwidth':>13s}")
    share = {}
    for name, v in ms.items():
        base = name.split(" without ")[0]
        share[name] = statistics.median(
            read[base] / t / bw for t, bw in zip(times[name], probes, strict=True)
        )
        print(f"  {name:28s} {v:8.1f} {read[base] / 1e6:9.1f} {share[name]:12.0%}")
    result = {"context": ctx, "gamma": a.gamma, "repeats": a.repeats, "ms": ms,
              "target_weights": weights, "read_bandwidth": bandwidth,
              "read_bandwidth_per_repeat": probes,
              "mb_read": {n: b / 1e6 for n, b in read.items()}, "of_bandwidth": share,
              "draft_head_rows": rows.get("draft", head), "vocab_size": head}  # fmt: skip
    result["ar_over_draft"] = ms["ar"] / ms["draft"]
    result["draft_over_target_ar"] = ms["draft"] / ms["target-ar"]
    if a.tokens_per_round:
        round_ms = a.gamma * ms["draft"] + ms["verify"]
        result["estimated_speedup"] = a.tokens_per_round * ms["ar"] / round_ms
        print(f"  estimate at {a.tokens_per_round} tokens per round: "
              f"{result['estimated_speedup']:.2f}x ar")  # fmt: skip
    print(f"  ar / draft: {result['ar_over_draft']:.2f}x; draft / target-ar step: "
          f"{result['draft_over_target_ar']:.2f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       **result}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
