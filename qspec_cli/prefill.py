"""`qspec prefill`: a document prefilled once and saved as a snapshot (`*.qspec`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from qspec_cli import common
from qspec_core.config import check_kv_group_size
from qspec_core.documents import is_stdin
from qspec_core.engine.session import ChatSession
from qspec_core.errors import QspecError


def prefill(
    file: Annotated[
        Path, typer.Argument(help="UTF-8 text document to prefill ('-': standard input).")
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Snapshot file to write (default: FILE with suffix .qspec; required for '-').",
        ),
    ] = None,
    model: common.ModelOpt = None,
    truncate: common.TruncOpt = False,
    group_size: common.GroupOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing snapshot.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    target_weights: common.TargetWeightsOpt = "auto",
    dtype: common.DtypeOpt = "auto",
    threads: common.ThreadsOpt = None,
):
    """Prefill a document once and save its hierarchical KV cache (a snapshot) to disk.

    Then `qspec chat SNAPSHOT` or `qspec summarize SNAPSHOT` answer without prefilling again,
    in this or another process, on this or another machine with the same model.
    """
    import time

    from qspec_cli.render import PrefillProgress, snapshot_size_line
    from qspec_core.cache.sizes import full_kv_bytes
    from qspec_core.engine.session import SNAPSHOT_ANSWER_ROOM
    from qspec_core.store.snapshot import check_output, estimate_bytes, save_snapshot

    check_kv_group_size(group_size)
    common.check_run_options(dtype, threads, target_weights)
    if is_stdin(file) and output is None:
        raise QspecError("a document read from standard input (-) needs -o/--output")
    output = output or file.with_suffix(".qspec")
    check_output(output, force)  # before the (long) prefill, and again with its size below
    if output.suffix != ".qspec":  # (chat and summarize tell a snapshot from a text by it)
        raise QspecError(f"{output}: a snapshot's name ends in .qspec")
    text = common.read_text(file)
    runtime = common.load(model, dtype, threads, target_weights=target_weights, full_weights=False)
    common.check_group_size(group_size, runtime)
    # --truncate leaves room for a question and an answer of chat's default length, so the
    # snapshot works with default settings
    session = ChatSession(
        runtime,
        text,
        mode="target-ar",
        truncate=truncate,
        group_size=group_size,
        max_new_tokens=min(SNAPSHOT_ANSWER_ROOM, runtime.context_limit // 2),
    )
    if session.truncated_tokens:
        common.warn(f"document truncated: dropped its last {session.truncated_tokens} tokens")
    prefix = session.document_prefix_ids()
    if len(prefix) + 16 > session.limit:
        raise QspecError(
            f"the document is {len(prefix)} tokens with its framing, the model's "
            f"context is {session.limit}; use --truncate"
        )
    need = estimate_bytes(
        runtime.model.config,
        len(prefix),
        group_size or runtime.model.config.head_dim,
        runtime.model.dtype,
        len(session.document.encode()),
    )
    check_output(output, force, need_bytes=need)
    progress = PrefillProgress(common.err)
    t0 = time.perf_counter()
    try:
        cache, ids = session.prefill_document(progress)
    finally:
        progress.stop()
    seconds = time.perf_counter() - t0
    manifest = save_snapshot(
        output,
        cache,
        ids,
        session.document,
        runtime.folder,
        runtime.name,
        force,
        extra={
            "prefill_seconds": round(seconds, 3),
            "compute_dtype": str(runtime.model.dtype),
            "target_weights": runtime.target_weights,
        },
    )
    size = output.stat().st_size
    bf16 = full_kv_bytes(runtime.model.config, len(ids))
    if as_json:
        print(json.dumps({"output": str(output), "bytes": size, "bf16_kv_bytes": bf16, **manifest}))
        return
    common.out.print(
        Text(
            f"wrote {output}: {len(ids):,} tokens prefilled in {seconds:.1f} s "
            f"({len(ids) / seconds:,.0f} tok/s)"
        )
    )
    common.out.print(snapshot_size_line(size, bf16))
