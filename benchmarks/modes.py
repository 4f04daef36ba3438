"""ar vs target-ar vs quantspec on one real document, side by side in one run.

Summarizes the document in each mode (greedy and sampled), interleaved over repeats, and
reports decode tokens/s, acceptance and tokens per target step (medians).

    python benchmarks/modes.py --doc qspec_core/data/apache-2.0.txt --gen 128 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from qspec_core.documents import read_document
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.session import SUMMARY_REQUEST, ChatSession
from qspec_core.registry.runtime import prepare_and_load


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=Path, default=Path("qspec_core/data/apache-2.0.txt"))
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gamma", default="4")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rt = prepare_and_load(None, dtype="auto", need_draft=True)
    document = read_document(args.doc)
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    configs = [(mode, t) for t in (0.0, 0.7) for mode in ("ar", "target-ar", "quantspec")]
    runs = {c: [] for c in configs}
    for r in range(args.repeats):
        for mode, temp in configs:
            session = ChatSession(
                rt,
                document,
                SamplingParams(temperature=temp),
                seed=r,
                max_new_tokens=args.gen,
                mode=mode,
                gamma=gamma,
            )
            for _ in session.ask(SUMMARY_REQUEST):
                pass
            st = session.last
            runs[(mode, temp)].append(
                {
                    "new_tokens": st.new_tokens,
                    "decode_tokens_per_s": st.decode_tokens_per_s,
                    "prefill_tokens_per_s": st.prefill_tokens_per_s,
                    "acceptance_rate": st.spec.acceptance_rate if st.spec else None,
                    "tokens_per_target_step": st.spec.tokens_per_target_step if st.spec else 1.0,
                    "timings_s": st.timings_s,
                }
            )
    rows = []
    for (mode, temp), samples in runs.items():
        med = {
            k: statistics.median(s[k] for s in samples)
            for k in ("decode_tokens_per_s", "tokens_per_target_step", "new_tokens")
        }
        acc = [s["acceptance_rate"] for s in samples if s["acceptance_rate"] is not None]
        med["acceptance_rate"] = statistics.median(acc) if acc else None
        rows.append({"mode": mode, "temperature": temp, **med, "samples": samples})
        acc_s = f"{med['acceptance_rate']:.1%}" if acc else "-"
        print(
            f"{mode:10s} T={temp:<4} decode {med['decode_tokens_per_s']:6.2f} tok/s  "
            f"acceptance {acc_s:>6}  tokens/target step {med['tokens_per_target_step']:.2f}"
            f"  ({med['new_tokens']:.0f} tokens)",
            flush=True,
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "doc": str(args.doc),
                    "gamma": args.gamma,
                    "dtype": str(rt.model.dtype),
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
