"""`qspec quality`: the INT8 and INT4 KV views measured against full precision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from qspec_cli import common
from qspec_core.config import check_kv_group_size
from qspec_core.documents import is_stdin
from qspec_core.errors import QspecError
from qspec_core.paths import BUNDLED_TEXTS


def quality(
    file: Annotated[
        Path | None,
        typer.Argument(
            help="UTF-8 text to evaluate on ('-': standard input; default: the bundled "
            "Apache-2.0 licence text)."
        ),
    ] = None,
    model: common.ModelOpt = None,
    group_size: common.GroupOpt = None,
    max_tokens: Annotated[int, typer.Option(min=16, help="Evaluate on the first N tokens.")] = 2048,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    dtype: common.DtypeOpt = "auto",
    threads: common.ThreadsOpt = None,
):
    """Measure the INT8 (target) and INT4 (draft) KV views against full precision.

    Perplexity, mean next-token KL and top-1 agreement on a real text, and KV bytes per token.
    """
    from qspec_core.bench.quality import measure_kv_quality

    check_kv_group_size(group_size)
    common.check_run_options(dtype, threads)
    path = file or BUNDLED_TEXTS / "apache-2.0.txt"
    text = common.read_text(path)
    runtime = common.load(model, dtype, threads, need_draft=True)  # carries the INT8 weights
    common.check_group_size(group_size, runtime)
    ids = runtime.tokenizer.encode(text)[:max_tokens]
    G = group_size or runtime.model.config.head_dim
    if len(ids) <= 2 * G:  # the KV of position p is quantized only up to (p // G - 1) * G
        raise QspecError(
            f"{'standard input' if is_stdin(path) else path}: {len(ids)} tokens, but with "
            f"G = {G} no KV is quantized before {2 * G + 1} tokens: use a longer text or "
            "a larger --max-tokens"
        )
    with common.err.status("measuring") as status:
        result = measure_kv_quality(
            runtime.model,
            ids,
            group_size,
            on_path=lambda p: status.update(f"path {p}"),
            runner=runtime.runner,
        )
    if as_json:
        print(json.dumps({"model": runtime.name, **result.to_dict()}))
        return
    from rich.table import Table

    source = "standard input" if is_stdin(path) else path.name
    title = f"{runtime.name} · {result.tokens} tokens of {source} · G = {result.group_size}"
    table = Table(title=Text(title), title_justify="left")
    for col in ("KV", "perplexity", "KL vs fp", "top-1 vs fp", "bytes/token"):
        table.add_column(col, justify="right" if col != "KV" else "left")
    fp_bytes = result.bytes_per_token["bf16"]
    table.add_row(
        "full precision", f"{result.perplexity['fp']:.4f}", "", "", f"{fp_bytes:,.0f} (bf16)"
    )

    def kv_bytes(p: str) -> str:  # the target's and the draft's KV views; fp KV: none given
        view = p.removeprefix("w8a8-").removeprefix("w8-")
        return f"{result.bytes_per_token[view]:,.0f}" if view in ("target", "draft") else ""

    labels = {
        "target": "target (INT8)",
        "draft": "draft (INT4)",
        "w8": "INT8 weights, fp KV",
        "w8-target": "INT8 weights + INT8 KV",
        "w8a8": "W8A8 (INT8 weights, int8 activations), fp KV",
        "w8a8-target": "W8A8 + INT8 KV (the CPU default target)",
    }
    for p, label in labels.items():
        if p not in result.perplexity:
            continue
        table.add_row(
            label,
            f"{result.perplexity[p]:.4f}",
            f"{result.kl_vs_fp[p]:.5f}",
            f"{result.top1_vs_fp[p]:.2%}",
            kv_bytes(p),
        )
    common.out.print(table)
    common.out.print(f"top-1 agreement draft vs target: {result.top1_draft_vs_target:.2%}")
