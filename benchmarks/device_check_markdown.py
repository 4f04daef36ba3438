"""device_check.md: the report's JSON as Markdown tables."""

from __future__ import annotations

import json

from device_check_harness import PEAK_GBPS


def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _attention_cell(row: dict, variant: str) -> str:
    if variant not in row.get("ms", {}):
        return "-"
    ms, rate = row["ms"][variant], row["gbps"][variant]
    return f"{ms:.4g} / {rate:.0f} / {100 * rate / PEAK_GBPS:.0f}%"


def render_markdown(data: dict) -> str:
    out = ["# Device check: hierarchical-cache kernels", ""]
    out += ["## Environment", "", "```", json.dumps(data.get("env", {}), indent=1), "```", ""]
    corr = data.get("correctness", [])
    attn_rows = [r for r in corr if "view" in r]
    if attn_rows:
        out += ["## Correctness (Triton vs twin, fp32 reference)", ""]
        out += _table(
            ["n_kv", "T", "view", "chunk", "dot", "late q", "max err", "max |ref|", "ok"],
            [
                [r["n_kv"], r["T"], r["view"], r["chunk"], r["precision"], r["late_queries"]]
                + [r["max_abs_err"], r["ref_max"], r["ok"]]
                for r in attn_rows
            ],
        ) + [""]
    for r in (r for r in corr if "kv_pack" in r):
        out.append(f"- kv_pack {r['kv_pack']}: mismatches {r['mismatches']}, ok {r['ok']}")
    variants = ("draft", "target", "sdpa_bf16", "dequant_sdpa")
    if data.get("attention"):
        out += ["", f"## Attention (ms / GB/s / % of {PEAK_GBPS:.0f} GB/s)", ""]
        rows = [
            [r["length"], r["n_kv"], r["T"], *(_attention_cell(r, v) for v in variants)]
            for r in data["attention"]
        ]
        out += _table(["L", "n_kv", "T", *variants], rows) + [""]
    if data.get("w4a16"):
        out += ["## W4A16 vs bf16 matmul", ""]
        keys = ("K", "N", "M", "w4a16_ms", "bf16_ms", "w4a16_gbps", "bf16_gbps", "speedup")
        out += _table(list(keys), [[r[k] for k in keys] for r in data["w4a16"]]) + [""]
    step = data.get("model_step", {})
    if step.get("rows"):
        out += [f"## Model step ({step['label']})", ""]
        out.append(
            f"acceptance {step['acceptance']}, gamma {step['gamma']}, "
            f"tokens per round {step['tokens_per_round']:.3f}; "
            "speedup = tokens per round / ((gamma * draft + verify) / ar)"
        )
        out += [""] + _table(
            ["L", "n_kv", "ar ms", "draft ms", "verify ms", "method", "projected speedup"],
            [
                [r["length"], r["n_kv"], *(r["ms"].get(k, "-") for k in ("ar", "draft", "verify"))]
                + ["/".join(sorted(set(r["method"].values()))), r.get("projected_speedup", "-")]
                for r in step["rows"]
            ],
        ) + [""]  # fmt: skip
    if data.get("kv_pack"):
        out += ["## kv_pack (quantize + pack) vs kernels.planes", ""]
        keys = ("tokens", "kv_heads", "kind", "triton_ms", "torch_ms", "triton_gbps", "speedup")
        out += _table(list(keys), [[r[k] for k in keys] for r in data["kv_pack"]]) + [""]
    if data.get("errors"):
        out += ["## Errors", ""] + [f"- {e['item']}: {e['error']}" for e in data["errors"]]
    if data.get("skipped"):
        out += ["", "Skipped (out of time): " + ", ".join(data["skipped"])]
    return "\n".join(out) + "\n"
