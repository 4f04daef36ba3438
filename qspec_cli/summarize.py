"""`qspec summarize`: a document (or a snapshot) summarized in one go, streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qspec_cli import common
from qspec_core.engine.session import SUMMARY_REQUEST


def summarize(
    file: Annotated[
        Path,
        typer.Argument(
            help="UTF-8 text document ('-': standard input), or a snapshot (*.qspec) made by "
            "qspec prefill."
        ),
    ],
    model: common.ModelOpt = None,
    mode: common.ModeOpt = "quantspec",
    gamma: common.GammaOpt = "auto",
    lookup: common.LookupOpt = True,
    max_new_tokens: common.MaxNewOpt = 384,
    temperature: common.TempOpt = 0.0,
    top_p: common.TopPOpt = 1.0,
    top_k: common.TopKOpt = 0,
    seed: common.SeedOpt = 0,
    truncate: common.TruncOpt = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
    group_size: common.GroupOpt = None,
    target_weights: common.TargetWeightsOpt = "auto",
    dtype: common.DtypeOpt = "auto",
    threads: common.ThreadsOpt = None,
):
    """Summarize FILE (a text document, or a snapshot from `qspec prefill`) in one go.

    Streams the summary, then a table of stage timings (and acceptance in quantspec mode).
    """
    from qspec_cli.render import PrefillProgress, stats_table
    from qspec_core.engine.summary import summary_record

    # every option, then the input, before any model loads
    params, drafts = common.check_session_options(
        mode, gamma, group_size, temperature, top_p, top_k, dtype, threads, target_weights
    )
    snapshot, text = common.read_input(file)
    session = common.load_session(
        model,
        dtype,
        threads,
        target_weights,
        snapshot,
        text,
        params=params,
        seed=seed,
        max_new_tokens=max_new_tokens,
        mode=mode,
        truncate=truncate,
        gamma=drafts,
        group_size=group_size,
        lookup=lookup,
    )
    runtime = session.runtime
    if session.truncated_tokens:
        common.warn(
            f"document truncated: dropped its last {session.truncated_tokens} "
            f"tokens to fit the {session.limit}-token context"
        )
    progress = PrefillProgress(common.err)
    try:
        for piece in session.ask(SUMMARY_REQUEST, on_prefill=progress):
            if not as_json:
                common.out.out(piece, end="")
    finally:
        progress.stop()
    if as_json:
        record = summary_record(session, runtime.name, runtime.target_weights)
        print(json.dumps(record, ensure_ascii=False))
    else:
        common.out.print()
        common.out.print()
        common.out.print(stats_table(session.last, f"{runtime.name} · mode {session.mode}"))
