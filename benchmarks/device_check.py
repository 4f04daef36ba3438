"""GPU check of the hierarchical-cache kernels: correctness at Llama-7B shapes, timings, and a
projected end-to-end speculative speedup.

Written for one unattended run on a lent GPU (about 8 minutes, no debugging there): every
item is guarded, results are written after each item, and on CUDA each section runs in its
own process with a time limit, so a crash (an illegal address poisons the CUDA context) or a
hang costs one section, not the report.

    python benchmarks/device_check.py --out $OUT              # CUDA: ~7 min, all sections
    python benchmarks/device_check.py --dry-run --out /tmp/x  # CPU, TRITON_INTERPRET=1, tiny

Writes device_check.json and device_check.md under --out (default: $OUT, else ".").
Sections: env, correctness (Triton vs the PyTorch twin), attention (draft / target view vs
bf16 SDPA vs dequantize-then-SDPA at 4k/32k/128k tokens, GB/s vs the H200's 4.8 TB/s),
w4a16 (vs a bf16 matmul), model_step (a timing projection of a 7B-shaped draft step, verify
step and autoregressive step: per layer the seven GEMMs plus attention, no norms/rope), and
kv_pack (quantize-and-pack vs kernels.planes). Uses only torch, triton and this repository.

The parts: device_check_harness.py (settings, report, timers), device_check_inputs.py
(synthetic caches and weights), device_check_kernels.py (correctness, attention, w4a16,
kv_pack), device_check_model_step.py, device_check_markdown.py; this file runs the sections.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
# the device_check_* modules beside this one, also when this file is loaded by path (tests)
sys.path.append(str(Path(__file__).resolve().parent))

from device_check_harness import DRY, REAL, Report, Settings
from device_check_kernels import (
    section_attention,
    section_correctness,
    section_kv_pack,
    section_w4a16,
)
from device_check_markdown import render_markdown
from device_check_model_step import section_model_step

SECTIONS = ("env", "correctness", "attention", "w4a16", "model_step", "kv_pack")
# Seconds each section may take on CUDA (its process is killed after), in run order.
SECTION_BUDGET_S = {
    "env": 30,
    "correctness": 90,
    "attention": 110,
    "w4a16": 40,
    "model_step": 150,
    "kv_pack": 40,
}


def section_env(s: Settings, report: Report) -> None:
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "device": s.device,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    report.data["env"] = env
    print(json.dumps(env), flush=True)


# ---------------------------------------------------------------------------------------------
# Driver


KERNEL_SECTIONS = {
    "correctness": section_correctness,
    "attention": section_attention,
    "w4a16": section_w4a16,
    "kv_pack": section_kv_pack,
}


def run_section(name: str, s: Settings, report: Report, args) -> None:
    if name == "env":
        with report.item("env") as go:
            if go:
                section_env(s, report)
    elif name == "model_step":
        section_model_step(s, report, args.acceptance, args.gamma)
    else:
        KERNEL_SECTIONS[name](s, report)


def _merge(total: dict, part: dict) -> None:
    for key, value in part.items():
        if key in ("errors", "skipped"):
            total.setdefault(key, []).extend(value)
        else:
            total[key] = value


def write_outputs(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(data, indent=1, default=str))
    try:
        text = render_markdown(data)
    except Exception:  # a partial row must not cost the JSON or the file
        text = "# Device check\n\nrendering failed:\n```\n" + traceback.format_exc() + "```\n"
    (out / "device_check.md").write_text(text)


def run_isolated(out: Path, args, deadline: float) -> dict:
    """Each section in its own process with a time limit; merge what each one left."""
    data: dict = {"errors": [], "skipped": []}
    for name in args.sections:
        left = deadline - time.monotonic()
        if left < 10:
            data["skipped"].append(name)
            continue
        budget = min(SECTION_BUDGET_S[name], left)
        part = out / "parts" / name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(part), "--section"]
        cmd += [name, "--budget-s", str(budget - 5), "--acceptance", str(args.acceptance)]
        cmd += ["--gamma", str(args.gamma)] + (["--dry-run"] if args.dry_run else [])
        print(f"== section {name} (limit {budget:.0f} s)", flush=True)
        try:
            result = subprocess.run(cmd, timeout=budget, capture_output=True, text=True)
            sys.stdout.write(result.stdout[-4000:])
            if result.returncode != 0:
                data["errors"].append(
                    {"item": f"section {name}", "error": f"exit {result.returncode}",
                     "traceback": result.stderr[-3000:]}
                )  # fmt: skip
        except subprocess.TimeoutExpired:
            data["errors"].append({"item": f"section {name}", "error": "timed out"})
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            _merge(data, json.loads((part / "part.json").read_text()))
        write_outputs(out, data)
    return data


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--acceptance", type=float, default=0.58)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--section", choices=SECTIONS, help="(internal) run one section here")
    ap.add_argument(
        "--isolate",
        choices=("auto", "yes", "no"),
        default="auto",
        help="one process per section (auto: on CUDA)",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    deadline = time.monotonic() + args.budget_s
    settings = DRY if args.dry_run else REAL
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on CPU", flush=True)

    if args.section:  # a child of run_isolated
        report = Report(args.out, deadline)
        run_section(args.section, settings, report, args)
        return report.data
    isolate = args.isolate == "yes" or (args.isolate == "auto" and settings.device == "cuda")
    if isolate:
        data = run_isolated(args.out, args, deadline)
    else:
        report = Report(args.out / "parts", deadline)
        for name in args.sections:
            run_section(name, settings, report, args)
            write_outputs(args.out, {"settings": asdict(settings), **report.data})
        data = report.data
    data = {"settings": asdict(settings), **data}
    write_outputs(args.out, data)
    print((args.out / "device_check.md").read_text(), flush=True)
    print(summary_line(data), flush=True)
    return data


def summary_line(data: dict) -> str:
    """One line for the end of a log: checks passed, errors, skipped, headline speedups."""
    checks = data.get("correctness", [])
    speedups = data.get("model_step", {}).get("projected_speedup", {})
    return (
        f"SUMMARY correctness {sum(c['ok'] for c in checks)}/{len(checks)} ok; "
        f"errors {len(data.get('errors', []))}; skipped {len(data.get('skipped', []))}; "
        "projected speedup " + ", ".join(f"{k}: {v:.2f}x" for k, v in speedups.items())
    )


if __name__ == "__main__":
    main()
