"""Summaries of real documents: target-ar against QuantSpec's recipes, side by side in one run.

For each document, greedy summaries in each variant, interleaved (document by document, every
variant in turn, then the next repeat): decode tokens/s, acceptance overall and per draft
source (4-bit path, document lookup, plain steps), tokens per verify, and whether each
variant's tokens equal target-ar's (they must: greedy QuantSpec is exact).

Variants:
  target-ar        the exact target path, one token a step (what every variant reproduces)
  quantspec        the default: `--gamma auto`, drafts from the 4-bit path and the document
                   (one chain a round, or a tree of the document's continuations)
  quantspec-chain  the default without token trees: one chain a round
  quantspec-g4-lookup  4 drafts a round, from the document when it proposes, else 4-bit
  quantspec-g4     the recipe before issue 19: 4 drafts a round, all from the 4-bit path

    python benchmarks/summaries.py --docs qspec_core/data/*.txt --gen 256 --json out.json

`--model` takes a converted folder (`qspec convert --recipe NAME`); `benchmarks/recipes.py`
runs this over every recipe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qspec_core.bench.runner import machine_info as bench_machine
from qspec_core.documents import read_document
from qspec_core.engine.session import SUMMARY_REQUEST, ChatSession
from qspec_core.registry.runtime import prepare_and_load

VARIANTS = {
    "target-ar": {"mode": "target-ar"},
    "quantspec": {"mode": "quantspec", "gamma": "auto", "lookup": True},
    "quantspec-chain": {"mode": "quantspec", "gamma": "auto", "lookup": True, "trees": False},
    "quantspec-g4-lookup": {"mode": "quantspec", "gamma": 4, "lookup": True},
    "quantspec-g4": {"mode": "quantspec", "gamma": 4, "lookup": False},
}


def summarize(runtime, document: str, gen: int, variant: dict) -> dict:
    session = ChatSession(runtime, document, max_new_tokens=gen, truncate=True, **variant)
    start = time.perf_counter()
    for _ in session.ask(SUMMARY_REQUEST):
        pass
    st = session.last
    row = {
        "prompt_tokens": st.prompt_tokens,
        "new_tokens": st.new_tokens,
        "decode_tokens_per_s": st.decode_tokens_per_s,
        "wall_s": time.perf_counter() - start,
        "tokens": session._cached_ids[st.prompt_tokens :],
    }
    if st.spec is not None:
        row["spec"] = st.spec.to_dict(variant.get("gamma"))
        # ms per draft step and per verify (the stages the session timed)
        draft_steps, rounds = st.spec.draft_steps, st.spec.rounds
        row["draft_ms"] = (
            1000 * st.timings_s.get("draft", 0.0) / draft_steps if draft_steps else None
        )
        row["verify_ms"] = 1000 * st.timings_s.get("verify", 0.0) / rounds if rounds else None
    return row


def machine_info(runtime) -> dict:
    return bench_machine(runtime, str(runtime.model.dtype)) | {
        "target_weights": runtime.target_weights
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=Path, nargs="+", required=True)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", help="a converted folder (default: the default model)")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    runtime = prepare_and_load(args.model, dtype="auto", need_draft=True, target_weights="auto")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for doc in args.docs:
            text = read_document(doc)
            for name in names:
                row = summarize(runtime, text, args.gen, VARIANTS[name])
                runs.setdefault((doc.name, name), []).append(row)
                spec = row.get("spec") or {}
                print(
                    f"{doc.name:18s} {name:20s} {row['decode_tokens_per_s']:7.1f} tok/s  "
                    f"{row['new_tokens']:4d} tokens  accept {spec.get('acceptance_rate', '-')}"
                    f"  per verify {spec.get('tokens_per_target_step', '-')}",
                    flush=True,
                )
    table = []
    for doc in args.docs:
        base = runs[(doc.name, names[0])]
        for name in names:
            rows = runs[(doc.name, name)]
            speed = statistics.median(r["decode_tokens_per_s"] for r in rows)
            ratio = statistics.median(
                r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for r, b in zip(rows, base, strict=True)
            )  # pair-wise within a repeat
            entry = {
                "doc": doc.name,
                "variant": name,
                "prompt_tokens": rows[0]["prompt_tokens"],
                "new_tokens": rows[0]["new_tokens"],
                "decode_tokens_per_s": speed,
                f"vs_{names[0]}": ratio,
                "same_tokens_as_first": all(
                    r["tokens"] == b["tokens"] for r, b in zip(rows, base, strict=True)
                ),
                "spec": rows[-1].get("spec"),
            }
            table.append(entry)
    print(f"\n{'document':18s} {'variant':20s} tok/s   vs {names[0]}  same  accept  per verify")
    for e in table:
        spec = e["spec"] or {}
        acc = f"{spec['acceptance_rate']:.0%}" if spec else ""
        per = f"{spec['tokens_per_target_step']:.2f}" if spec else ""
        print(
            f"{e['doc']:18s} {e['variant']:20s} {e['decode_tokens_per_s']:6.1f}  "
            f"{e[f'vs_{names[0]}']:5.2f}x  {str(e['same_tokens_as_first']):5s}  {acc:>5s}  {per}"
        )
    if args.json:
        machine = machine_info(runtime)
        out = {"gen": args.gen, "repeats": args.repeats, "machine": machine, "table": table}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
