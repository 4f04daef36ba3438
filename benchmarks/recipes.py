"""The draft recipe sweep (issue 19): every named recipe on the same documents, one run.

For each recipe (`qspec_core/convert/recipes.py`) the default model is converted once into
`--work/NAME` (kept: a rerun reuses it), then every document is summarized greedily by
  target-ar      the exact target path (the same INT8 target in every recipe)
  quantspec-g4   4 drafts a round, all from the 4-bit path: the recipe's own acceptance,
                 tokens per verify, ms per draft step and per verify
  quantspec      the default (`--gamma auto`, document lookup): what a user gets
and the tokens of both quantspec variants are checked against target-ar's (greedy is exact).
The table gives, per recipe, the draft's weight bytes per step (the bytes `qspec bench`
counts), its top-1 agreement with the target on the calibration text (from the conversion's
report), and the means over documents; decode speeds are also given as ratios to target-ar
measured in the same recipe's block (same minutes). Pick the default by `quantspec` decode
speed, not by acceptance alone.

    python benchmarks/recipes.py --work /tmp/qspec-recipes --gen 128 \\
        --docs qspec_core/data/apache-2.0.txt qspec_core/data/mpl-2.0.txt other.md \\
        --json docs/recipes-sweep.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

from summaries import VARIANTS, machine_info, summarize

from qspec_core.bench.bandwidth import path_weight_bytes
from qspec_core.convert.info import read_draft_meta
from qspec_core.convert.recipes import RECIPES
from qspec_core.documents import read_document
from qspec_core.paths import BUNDLED_TEXTS
from qspec_core.registry.prepare import CALIB_TEXT, CALIB_TOKENS
from qspec_core.registry.runtime import prepare_and_load

SWEEP_VARIANTS = ("target-ar", "quantspec-g4", "quantspec")


def converted(work: Path, name: str) -> Path:
    """WORK/NAME converted by `qspec convert --recipe NAME` (made once)."""
    folder = work / name
    try:
        if read_draft_meta(folder).get("recipe", {}).get("name") == name:
            return folder
    except Exception:  # noqa: BLE001 (absent or half-written: convert again)
        pass
    cmd = [
        str(Path(sys.executable).parent / "qspec"), "convert", "--recipe", name, "-o", str(folder),
        "--calib", str(BUNDLED_TEXTS / CALIB_TEXT), "--calib-tokens", str(CALIB_TOKENS),
        "--force", "--json",
    ]  # fmt: skip
    print(f"converting {name} ...", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return folder


def sweep_one(folder: Path, docs: list[Path], gen: int) -> dict:
    runtime = prepare_and_load(str(folder), dtype="auto", need_draft=True, target_weights="auto")
    model = runtime.model
    meta = read_draft_meta(folder)
    rows: dict[str, list[dict]] = {v: [] for v in SWEEP_VARIANTS}
    for doc in docs:
        text = read_document(doc)
        for v in SWEEP_VARIANTS:
            row = summarize(runtime, text, gen, VARIANTS[v])
            row["doc"] = doc.name
            rows[v].append(row)
        base = rows["target-ar"][-1]["tokens"]
        for v in SWEEP_VARIANTS[1:]:
            rows[v][-1]["same_as_target_ar"] = rows[v][-1]["tokens"] == base
        g4, auto = rows["quantspec-g4"][-1], rows["quantspec"][-1]
        print(
            f"  {doc.name:22s} accept {g4['spec']['acceptance_rate']:.0%}  per verify "
            f"{g4['spec']['tokens_per_target_step']:.2f}  draft {g4['draft_ms']:.2f} ms  "
            f"verify {g4['verify_ms']:.2f} ms  tok/s ar {base_speed(rows):.1f} "
            f"g4 {g4['decode_tokens_per_s']:.1f} auto {auto['decode_tokens_per_s']:.1f}",
            flush=True,
        )
    out = {
        "recipe": meta.get("recipe"),
        "modules_4bit": len(meta["modules"]),
        "group_size": meta["group_size"],
        "top1_agreement_calibration": meta["report"]["top1_agreement"],
        "draft_weight_mb": path_weight_bytes(model, "int4") / 1e6,
        "target_weight_mb": path_weight_bytes(model, runtime.target_weights) / 1e6,
        "machine": machine_info(runtime),
        "docs": {v: [{k: x for k, x in r.items() if k != "tokens"} for r in rs]
                 for v, rs in rows.items()},
    }  # fmt: skip
    g4 = rows["quantspec-g4"]
    out["mean"] = {
        "acceptance_g4": statistics.mean(r["spec"]["acceptance_rate"] for r in g4),
        "tokens_per_verify_g4": statistics.mean(r["spec"]["tokens_per_target_step"] for r in g4),
        "draft_ms": statistics.mean(r["draft_ms"] for r in g4),
        "verify_ms": statistics.mean(r["verify_ms"] for r in g4),
        **{
            f"{v}_tokens_per_s": statistics.mean(r["decode_tokens_per_s"] for r in rows[v])
            for v in SWEEP_VARIANTS
        },
        **{
            f"{v}_vs_target_ar": statistics.mean(
                r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for r, b in zip(rows[v], rows["target-ar"], strict=True)
            )
            for v in SWEEP_VARIANTS[1:]
        },
        "all_same_as_target_ar": all(
            r["same_as_target_ar"] for v in SWEEP_VARIANTS[1:] for r in rows[v]
        ),
    }
    del runtime, model
    gc.collect()
    return out


def base_speed(rows: dict) -> float:
    return rows["target-ar"][-1]["decode_tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--work", type=Path, required=True, help="where the converted folders live")
    ap.add_argument("--docs", type=Path, nargs="+", required=True)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"unknown recipes {unknown} (have: {', '.join(RECIPES)})")
    args.work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        folder = converted(args.work, name)
        print(f"{name}:", flush=True)
        results[name] = sweep_one(folder, args.docs, args.gen)
        if args.json:  # after every recipe: a long sweep cut short keeps what it measured
            out = {"gen": args.gen, "docs": [d.name for d in args.docs], "recipes": results}
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"\n{'recipe':12s} {'4-bit':>5s} {'MB/draft':>8s} {'top1':>5s} {'accept':>6s} "
        f"{'tok/ver':>7s} {'draft ms':>8s} {'ver ms':>7s} {'ar':>6s} {'g4':>6s} {'auto':>6s} "
        f"{'auto/ar':>7s} same"
    )
    for name, r in results.items():
        m = r["mean"]
        print(
            f"{name:12s} {r['modules_4bit']:5d} {r['draft_weight_mb']:8.1f} "
            f"{r['top1_agreement_calibration']:5.1%} {m['acceptance_g4']:6.1%} "
            f"{m['tokens_per_verify_g4']:7.2f} {m['draft_ms']:8.2f} {m['verify_ms']:7.2f} "
            f"{m['target-ar_tokens_per_s']:6.1f} {m['quantspec-g4_tokens_per_s']:6.1f} "
            f"{m['quantspec_tokens_per_s']:6.1f} {m['quantspec_vs_target_ar']:7.2f} "
            f"{m['all_same_as_target_ar']}"
        )


if __name__ == "__main__":
    main()
