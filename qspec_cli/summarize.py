"""`qspec summarize`: a document (or a snapshot) summarized in one go, streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qspec_cli import common
from qspec_core.engine.session import SUMMARY_REQUEST
from qspec_core.errors import QspecError


def summarize(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="UTF-8 text document ('-': standard input), or a snapshot (*.qspec) made by "
            "qspec prefill. With -o: any number of documents and folders (a folder gives its "
            "text files: .txt .md .rst ..., recursively, sorted).",
            show_default=False,
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Batch: append one JSON record per document to this .jsonl file (path, "
            "sha256, settings_key, the --json fields, or error). A rerun skips documents "
            "already summarized with the same settings and retries the rest.",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Batch: worker processes, each with its own model and --threads / N "
            "threads (with --ray: Ray actors).",
        ),
    ] = 1,
    ray: Annotated[
        str | None,
        typer.Option(
            help="Batch: run the workers as Ray actors: 'local' starts Ray on this machine, "
            "else a cluster address ('auto', 'ray://host:10001'). Needs pip install qspec[ray].",
        ),
    ] = None,
    snapshots: Annotated[
        Path | None,
        typer.Option(
            help="Batch: keep each document's prefilled KV snapshot in this folder; a later "
            "batch (e.g. with another --prompt) loads it instead of prefilling again.",
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option(help="The request to answer about each document (default: a summary)."),
    ] = None,
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
    With -o out.jsonl: a batch over FILES and folders, one model load, resumable, with a
    progress bar; --workers and --ray run it on several processes or machines.
    """
    from qspec_cli.render import PrefillProgress, stats_table
    from qspec_core.batch.job import BatchSettings
    from qspec_core.engine.summary import summary_record

    # every option, then the input, before any model loads
    _, drafts = common.check_session_options(
        mode, gamma, group_size, temperature, top_p, top_k, dtype, threads, target_weights
    )
    # one document or a batch, the same settings (a batch's workers open their sessions alike)
    settings = BatchSettings(
        model, mode, drafts, lookup, max_new_tokens, temperature, top_p, top_k, seed,
        truncate, group_size, target_weights, dtype, prompt or SUMMARY_REQUEST,
    )  # fmt: skip
    if output is not None:
        from qspec_cli.batch import run_batch

        run_batch(files, output, settings, workers, ray, snapshots, threads, as_json)
        return
    batch_only = {"--workers": workers != 1, "--ray": ray, "--snapshots": snapshots}
    for name, given in batch_only.items():
        if given:
            raise QspecError(f"{name} is for batches: add -o out.jsonl")
    if len(files) != 1:
        raise QspecError("several documents make a batch: add -o out.jsonl")
    file = files[0]
    if file.is_dir():
        raise QspecError(f"{file}: is a folder; to summarize its documents, add -o out.jsonl")
    snapshot, text = common.read_input(file)
    kwargs = settings.session_kwargs()
    session = common.load_session(model, dtype, threads, target_weights, snapshot, text, **kwargs)
    runtime = session.runtime
    if session.truncated_tokens:
        common.warn(
            f"document truncated: dropped its last {session.truncated_tokens} "
            f"tokens to fit the {session.limit}-token context"
        )
    progress = PrefillProgress(common.err)
    try:
        for piece in session.ask(settings.prompt, on_prefill=progress):
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
