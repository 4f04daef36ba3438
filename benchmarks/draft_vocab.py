"""The draft's vocabulary slice on and off, side by side in one process (`engine/draft_vocab.py`).

For each context: the bench prompt prefilled once per run, then `--gen` greedy tokens decoded
speculatively with the draft's head whole (`draft_common` None) and sliced (the default),
alternating over `--repeats`; reports decode tokens/s, the draft stage's ms per draft step,
the acceptance and the slice's rows (medians). The text is the same both ways (checked).

    python benchmarks/draft_vocab.py --context 2k,8k --target w8a8,full --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qspec_core.bench.corpus import bench_prompt
from qspec_core.bench.runner import parse_contexts
from qspec_core.engine.draft_vocab import COMMON_IDS, DraftVocab
from qspec_core.engine.generate import prefill_hierarchical
from qspec_core.engine.plan import DecodePlan
from qspec_core.engine.sampling import SamplingParams
from qspec_core.precision import DRAFT, TARGET
from qspec_core.registry.runtime import prepare_and_load
from qspec_core.timing import StageTimer


@torch.inference_mode()
def run(runtime, prompt: list[int], plan: DecodePlan, gen: int) -> dict:
    runner = runtime.runner
    cache = plan.new_cache(runner, len(prompt) + gen + 20)
    logits = prefill_hierarchical(runner, cache, prompt, weights=plan.target.weights)
    timer = StageTimer()
    started = time.perf_counter()
    tokens, stats = plan.start(
        runner, cache, logits, prompt, gen, SamplingParams(), torch.Generator(), timer=timer
    )
    tokens = list(tokens)
    seconds = time.perf_counter() - started
    steps = max(stats.draft_steps, 1)
    return {
        "tokens": tokens,
        "decode_tokens_per_s": len(tokens) / seconds,
        "draft_ms_per_step": timer.seconds.get("draft", 0.0) / steps * 1e3,
        "draft_steps": stats.draft_steps,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_target_step": stats.tokens_per_target_step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="2k,8k")
    ap.add_argument("--target", default="w8a8,full", help="target weights, comma-separated")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--gamma", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    runtime = prepare_and_load(None, dtype="fp32", need_draft=True, log=lambda *_: None)
    gamma = a.gamma if a.gamma == "auto" else int(a.gamma)
    out = []
    for context in parse_contexts(a.context):
        prompt = bench_prompt(runtime.tokenizer, context)
        rows = len(DraftVocab.build(runtime.model, prompt, DRAFT).ids)
        for weights in a.target.split(","):
            target = TARGET.with_weights(weights)
            plans = {
                "whole": DecodePlan(target, DRAFT, gamma, draft_common=None),
                "sliced": DecodePlan(target, DRAFT, gamma, draft_common=COMMON_IDS),
            }
            runs = {name: [] for name in plans}
            for _ in range(a.repeats):
                for name, plan in plans.items():
                    runs[name].append(run(runtime, prompt, plan, a.gen))
            texts = {tuple(r.pop("tokens")) for rs in runs.values() for r in rs}
            result = {"context": len(prompt), "target": weights, "slice_rows": rows,
                      "same_text": len(texts) == 1}  # fmt: skip
            for name, rs in runs.items():
                result[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                result[name]["decode_runs"] = [round(r["decode_tokens_per_s"], 1) for r in rs]
            out.append(result)
            w, s = result["whole"], result["sliced"]
            print(f"{len(prompt)} tokens, {weights} target, slice {rows} rows: decode "
                  f"{w['decode_tokens_per_s']:.1f} -> {s['decode_tokens_per_s']:.1f} tok/s, draft "
                  f"step {w['draft_ms_per_step']:.2f} -> {s['draft_ms_per_step']:.2f} ms, "
                  f"acceptance {w['acceptance_rate']:.3f} -> {s['acceptance_rate']:.3f}, "
                  f"same text: {result['same_text']}", flush=True)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "gen": a.gen, "gamma": a.gamma,
                       "results": out}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
