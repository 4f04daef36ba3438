"""The peers' results: one row per peer and context (medians, min-max), token agreement
between peers, and the rich table."""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import asdict

from peers_sample import Prompt, Sample


def spread(values: list[float]) -> dict:
    """Median, min and max, ignoring NaN (None where nothing is left: JSON has no NaN)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def result_row(peer, prompt: Prompt, samples: list[Sample]) -> dict:
    return {
        "peer": peer.name,
        "family": peer.family,
        **peer.meta,
        "context": prompt.context,
        "prompt_tokens": samples[0].prompt_tokens,
        "new_tokens": samples[0].new_tokens,
        "runs": len(samples),
        "ttft_s": spread([s.ttft_s for s in samples]),
        "prefill_tokens_per_s": spread([s.prefill_tokens_per_s for s in samples]),
        "decode_tokens_per_s": spread([s.decode_tokens_per_s for s in samples]),
        "ms_per_token": spread([1e3 / s.decode_tokens_per_s for s in samples]),
        "tokens": samples[0].tokens,
        "samples": [
            {k: v for k, v in asdict(s).items() if k != "tokens"} | {"total_s": s.total_s}
            for s in samples
        ],
    }


def mark_agreement(rows: list[dict]) -> None:
    """Mark each row with how many leading tokens match hf-fp32's (else the first row's)."""
    from qspec_core.engine.session import common_prefix

    for context in {r["context"] for r in rows}:
        same = [r for r in rows if r["context"] == context]
        ref = next((r for r in same if r["peer"] == "hf-fp32"), same[0])
        for r in same:
            n = common_prefix(r["tokens"], ref["tokens"])
            r["agree_with"] = ref["peer"] if r["tokens"] else None
            r["agree_tokens"] = n if r["tokens"] else None


def _cell(stats: dict, fmt: str) -> str:
    if stats["median"] is None:
        return "-"
    text = format(stats["median"], fmt)
    if stats["min"] != stats["max"]:
        text += f" ({format(stats['min'], fmt)}-{format(stats['max'], fmt)})"
    return text


def render_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["machine"]
    title = f"Peers: {m['cpu']}, {m['threads']} threads, {result['settings']['gen']} new tokens"
    table = Table(title=title, caption="median (min-max) over runs")
    for name in ("peer", "cache", "context", "prompt tok", "TTFT s", "prefill tok/s"):
        table.add_column(name, justify="left" if name in ("peer", "cache") else "right")
    for name in ("decode tok/s", "ms/token", "runs", "agree"):
        table.add_column(name, justify="right")
    for r in result["results"]:
        agree = "" if r["agree_tokens"] is None else f"{r['agree_tokens']}/{len(r['tokens'])}"
        table.add_row(
            r["peer"],
            r["cache"],
            str(r["context"]),
            str(r["prompt_tokens"]),
            _cell(r["ttft_s"], ".2f"),
            _cell(r["prefill_tokens_per_s"], ".0f"),
            _cell(r["decode_tokens_per_s"], ".1f"),
            _cell(r["ms_per_token"], ".1f"),
            str(r["runs"]),
            agree,
        )
    console = Console(width=None if sys.stdout.isatty() else 160)  # whole cells in logs too
    console.print(table)
    for note in result["notes"]:
        console.print(f"note: {note}")
