"""Autoregressive qspec vs Hugging Face transformers `generate`, side by side in one run.

Same weights, dtype, threads, prompts (bundled real texts) and number of new tokens. Runs are
interleaved (ours, theirs, ours, theirs, ...) so machine drift hits both alike; medians over
repeats. Prefill = one pass over the prompt; decode = the tokens after the first.

    python benchmarks/ar_vs_transformers.py --sizes 500,7500 --gen 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.engine.generate import decode, prefill
from qspec_core.engine.sampling import SamplingParams
from qspec_core.registry.runtime import load_runtime

DATA = Path(__file__).resolve().parent.parent / "qspec_core" / "data"


def prompt_ids(tokenizer, n_tokens: int) -> list[int]:
    text = "\n\n".join((DATA / name).read_text() for name in ("gpl-3.0.txt", "apache-2.0.txt"))
    ids = tokenizer.encode(text)
    if len(ids) < n_tokens:
        raise SystemExit(f"bundled texts hold {len(ids)} tokens, fewer than {n_tokens}")
    return ids[:n_tokens]


def run_ours(model, ids, gen):
    """Same split as run_hf: prefill until the first logits, then `gen` decode steps.
    `model`: the runtime's runner."""
    cache = FullPrecisionCache(model.config, len(ids) + gen, dtype=model.dtype)
    t0 = time.perf_counter()
    logits = prefill(model, cache, ids, 0)
    t1 = time.perf_counter()
    n = sum(1 for _ in decode(model, cache, logits, len(ids), gen + 1, SamplingParams(), None))
    t2 = time.perf_counter()
    assert n == gen + 1
    return t1 - t0, t2 - t1


class _StepClock:
    """A logits processor that only records when each generation step's logits arrive."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_hf(model, ids, gen):
    from transformers import LogitsProcessorList

    clock = _StepClock()
    t0 = time.perf_counter()
    model.generate(
        torch.tensor([ids]),
        max_new_tokens=gen + 1,
        min_new_tokens=gen + 1,
        do_sample=False,
        logits_processor=LogitsProcessorList([clock]),
    )
    # step 0's logits end the prefill; steps 1..gen are the decode
    return clock.times[0] - t0, clock.times[-1] - clock.times[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="500,7500", help="prompt lengths in tokens")
    ap.add_argument("--gen", type=int, default=64, help="decoded tokens after the first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import transformers

    rt = load_runtime(None, dtype=args.dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(rt.folder, dtype=rt.model.dtype).eval()
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        ids = prompt_ids(rt.tokenizer, size)
        runs = {"qspec-ar": [], "transformers": []}
        for _ in range(args.repeats):
            runs["qspec-ar"].append(run_ours(rt.runner, ids, args.gen))
            runs["transformers"].append(run_hf(hf, ids, args.gen))
        for name, samples in runs.items():
            pre = statistics.median(s[0] for s in samples)
            dec = statistics.median(s[1] for s in samples)
            row = {
                "impl": name,
                "prompt_tokens": size,
                "new_tokens": args.gen,
                "prefill_s": pre,
                "prefill_tokens_per_s": size / pre,
                "decode_s": dec,
                "decode_tokens_per_s": args.gen / dec,
                "samples": samples,
            }
            results.append(row)
            print(
                f"{name:13s} prompt {size:5d}: prefill {size / pre:8.1f} tok/s   "
                f"decode {args.gen / dec:6.2f} tok/s",
                flush=True,
            )
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(rt.model.dtype),
    }
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=2))


if __name__ == "__main__":
    main()
