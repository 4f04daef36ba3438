"""`qspec` command line: parse, call one library function, render. No logic of its own."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from qspec_core.config import check_kv_group_size
from qspec_core.documents import is_stdin, read_document
from qspec_core.errors import QspecError
from qspec_core.paths import check_output_file
from qspec_core.engine.sampling import MIN_TEMPERATURE, SamplingParams
from qspec_core.engine.session import MODES, SUMMARY_REQUEST, ChatSession

app = typer.Typer(
    help="qspec: chat with and summarize long documents, fast, on one GPU or a plain CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# emoji=False: a file named `a:cat:b.txt` keeps its name. User strings (paths, model names,
# messages) are printed as `Text`, never as markup: `x[/red].txt` would raise MarkupError,
# and `rich.markup.escape` renders a trailing backslash doubled at the end of a line.
out = Console(highlight=False, emoji=False)
err = Console(stderr=True, highlight=False, emoji=False)


def _log(message: str) -> None:
    err.print(Text(message, style="dim"), soft_wrap=True)  # paths stay whole, copy-pastable


def _warn(message: str) -> None:
    err.print(Text(message, style="yellow"))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Library warnings (the CPU kernel build, torch) as one plain line, not Python's
    `file:line: UserWarning:` with a source line under it."""
    _warn(f"warning: {str(message).removeprefix('qspec: ')}")


def _print_error(message: str) -> None:
    """`error: MESSAGE` as exactly one line: a message may hold newlines (a library's error,
    a file name) and must not be wrapped at the terminal's width either."""
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    err.print(Text.assemble(("error:", "red"), " ", line), soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        import qspec_core

        print(f"qspec {qspec_core.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool | None,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
):
    """qspec: chat with and summarize long documents, fast, on one GPU or a plain CPU."""


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model folder (HF safetensors), .gguf file, hub id, or a named model "
        "(qwen2.5-coder-0.5b: 32k context, opt-in download). "
        "Default: SmolLM2-135M-Instruct, converted once into $QSPEC_HOME.",
    ),
]
ModeOpt = Annotated[
    str,
    typer.Option(
        help="quantspec: self-speculative (4-bit draft, INT8-KV verify; needs a converted model, "
        "the default one is converted on first use); target-ar: autoregressive on the "
        "target path (the distribution quantspec reproduces); ar: full-precision baseline."
    ),
]
GammaOpt = Annotated[
    str,
    typer.Option(help="Draft tokens per round (1-16), or 'auto' to adapt it to recent acceptance."),
]


GroupOpt = Annotated[
    int | None,
    typer.Option(
        help="KV quantization group G: even, divides head_dim, above --gamma "
        "(default: the model's head_dim)."
    ),
]


def _read_text(path: Path) -> str:
    """A document's text, read once: a FIFO or a pipe (`-`) cannot be read a second time."""
    if is_stdin(path) and sys.stdin.isatty():
        _log("reading the document from standard input: end it with Ctrl-D")
    return read_document(path)


def _input(file: Path) -> tuple[Path | None, str | None]:
    """FILE of summarize: (snapshot, None) for a `*.qspec`, else (None, the document's text).
    Either way checked before any model loads."""
    if file.suffix == ".qspec":
        from qspec_core.store.snapshot import read_manifest

        read_manifest(file)  # not a snapshot, or a damaged one: say so before loading
        return file, None
    return None, _read_text(file)


def _session(snapshot: Path | None, text: str | None, runtime, **kwargs) -> ChatSession:
    """A session over a snapshot (`*.qspec`, no re-prefill) or over a document's text."""
    if snapshot is not None:
        from qspec_core.store.snapshot import load_snapshot

        snap = load_snapshot(
            snapshot,
            runtime.folder,
            runtime.model,
            runtime.context_limit,
            kwargs.get("group_size"),
        )
        # the snapshot's document is what was prefilled (cut already if it was too long):
        # cutting it again here would change its tokens
        session = ChatSession(runtime, snap.document, **{**kwargs, "truncate": False})
        session.adopt_cache(snap.cache, snap.token_ids)
        return session
    return ChatSession(runtime, text, **kwargs)


def _gamma(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        gamma = int(value)
    except ValueError:
        raise QspecError(f"--gamma must be a number or 'auto', not {value!r}") from None
    if not 1 <= gamma <= 16:
        raise QspecError(f"--gamma must be in 1..16, not {gamma}")
    return gamma


MaxNewOpt = Annotated[int, typer.Option(min=1, help="Most tokens to generate per answer.")]
# temperature and top-p are checked by SamplingParams (finite, in range), one message for all
TempOpt = Annotated[
    float,
    typer.Option(help=f"Sampling temperature: 0 is greedy, else at least {MIN_TEMPERATURE}."),
]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")]
TopKOpt = Annotated[int, typer.Option(min=0, help="Sample from the k likeliest tokens; 0: all.")]
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
SeedOpt = Annotated[
    int,
    typer.Option(min=0, max=SEED_MAX, help="Seed of the sampling generator (runs reproduce)."),
]
TruncOpt = Annotated[
    bool,
    typer.Option("--truncate", help="Cut the end of a document longer than the model's context."),
]
DtypeOpt = Annotated[
    str, typer.Option(help="Weights/activations dtype: bf16 (CPU default), fp16, fp32.")
]
ThreadsOpt = Annotated[int | None, typer.Option(min=1, help="CPU threads (default: all cores).")]
TargetWeightsOpt = Annotated[
    str,
    typer.Option(
        help="Weights of the target (verify) path: full (the checkpoint) or int8 (per-channel "
        "INT8, Quasar-style; output then follows the INT8-weight model). int8 needs a folder "
        "from qspec convert (the default model's is made on first use)."
    ),
]
TARGET_DISTRIBUTION = {
    "full": "the target path: full-precision weights, INT8 KV (ar: full-precision KV)",
    "int8": "the INT8-weight target path: per-channel INT8 weights, INT8 KV (ar: full KV)",
}


def _check_run_options(dtype: str, threads: int | None, target_weights: str = "full") -> None:
    """Options `_load` uses, checked before anything is read or loaded."""
    from qspec_core.registry.runtime import DTYPES

    if dtype != "auto" and dtype not in DTYPES:
        raise QspecError(f"--dtype must be auto or one of {', '.join(DTYPES)}, not {dtype!r}")
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cpus:
        # more threads than CPUs only slows a CPU-bound step; far more crashes the kernels
        raise QspecError(f"--threads must be in 1..{cpus} (the CPUs here), not {threads}")
    if target_weights not in TARGET_DISTRIBUTION:
        raise QspecError(
            f"--target-weights must be {' or '.join(TARGET_DISTRIBUTION)}, not {target_weights!r}"
        )


def _load(
    model: str | None,
    dtype: str,
    threads: int | None,
    quiet: bool = False,
    need_draft: bool = False,
    target_weights: str = "full",
):
    import torch

    from qspec_core.registry.runtime import load_runtime

    # (every command runs _check_run_options before anything slow, so not again here)
    if threads:
        torch.set_num_threads(threads)
    log = (lambda msg: None) if quiet else _log
    return load_runtime(
        model, dtype=dtype, log=log, need_draft=need_draft, target_weights=target_weights
    )


def _check_group_size(group_size: int | None, runtime, gamma: int | str | None = None) -> None:
    """The part of --group-size (and --gamma) that depends on the model, checked as soon as it
    is loaded: before any prefill."""
    check_kv_group_size(group_size, runtime.model.config.head_dim, gamma)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise QspecError(f"mode {mode!r} is not available (have: {', '.join(MODES)})")


def _params(temperature: float, top_p: float, top_k: int) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    except ValueError as e:
        raise QspecError(str(e)) from None


@app.command()
def summarize(
    file: Annotated[
        Path,
        typer.Argument(
            help="UTF-8 text document ('-': standard input), or a snapshot (*.qspec) made by "
            "qspec prefill."
        ),
    ],
    model: ModelOpt = None,
    mode: ModeOpt = "quantspec",
    gamma: GammaOpt = "4",
    max_new_tokens: MaxNewOpt = 384,
    temperature: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    truncate: TruncOpt = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
    group_size: GroupOpt = None,
    target_weights: TargetWeightsOpt = "full",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
):
    """Summarize FILE (a text document, or a snapshot from `qspec prefill`) in one go.

    Streams the summary, then a table of stage timings (and acceptance in quantspec mode).
    """
    from qspec_cli.render import PrefillProgress, stats_table

    # every option, then the input, before any model loads
    params = _params(temperature, top_p, top_k)
    _check_mode(mode)
    drafts = _gamma(gamma)
    spec_gamma = drafts if mode == "quantspec" else None
    check_kv_group_size(group_size, gamma=spec_gamma)
    _check_run_options(dtype, threads, target_weights)
    snapshot, text = _input(file)
    runtime = _load(
        model, dtype, threads, need_draft=mode == "quantspec", target_weights=target_weights
    )
    _check_group_size(group_size, runtime, spec_gamma)
    session = _session(
        snapshot,
        text,
        runtime,
        params=params,
        seed=seed,
        max_new_tokens=max_new_tokens,
        mode=mode,
        truncate=truncate,
        gamma=drafts,
        group_size=group_size,
    )
    if session.truncated_tokens:
        _warn(
            f"document truncated: dropped its last {session.truncated_tokens} "
            f"tokens to fit the {session.limit}-token context"
        )
    progress = PrefillProgress(err)
    try:
        for piece in session.ask(SUMMARY_REQUEST, on_prefill=progress):
            if not as_json:
                out.out(piece, end="")
    finally:
        progress.stop()
    stats = session.last
    if as_json:
        result = {
            "text": session.last_text,
            "mode": session.mode,
            "target_weights": target_weights,
            "reproduces": TARGET_DISTRIBUTION[target_weights]
            if session.mode != "ar"
            else "the full-precision model"
            + (" with INT8 weights" if target_weights == "int8" else ""),
            "model": runtime.name,
            "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens,
            "tokens_per_s": round(stats.decode_tokens_per_s, 3),
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 3),
            "truncated_tokens": session.truncated_tokens,
            "timings_s": {k: round(v, 6) for k, v in stats.timings_s.items()},
        }
        if stats.spec is not None:
            result["stats"] = stats.spec.to_dict(session.gamma)
        print(json.dumps(result, ensure_ascii=False))
    else:
        out.print()
        out.print()
        out.print(stats_table(stats, f"{runtime.name} · mode {session.mode}"))


@app.command()
def chat(
    snapshot: Annotated[
        Path | None,
        typer.Argument(
            help="A snapshot (*.qspec) from qspec prefill: chat without prefilling again."
        ),
    ] = None,
    document: Annotated[
        Path | None,
        typer.Option(
            "--document", "-d", help="UTF-8 text document to ask about ('-': standard input)."
        ),
    ] = None,
    model: ModelOpt = None,
    mode: ModeOpt = "quantspec",
    gamma: GammaOpt = "4",
    max_new_tokens: MaxNewOpt = 512,
    temperature: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    truncate: TruncOpt = False,
    group_size: GroupOpt = None,
    target_weights: TargetWeightsOpt = "full",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
):
    """Interactive multi-turn chat, streamed. Commands: /exit, /reset, /stats.

    Ctrl-C stops the current answer and keeps the session; Ctrl-D or /exit leaves.
    """
    from qspec_cli.render import PrefillProgress, session_title, stats_table

    if snapshot is not None and document is not None:
        raise QspecError("give a snapshot or --document, not both")
    if snapshot is not None and snapshot.suffix != ".qspec":
        raise QspecError(
            f"{snapshot}: a snapshot file ends in .qspec (for a text file, use --document)"
        )
    if is_stdin(document) and not sys.stdin.isatty():
        # the questions are read from standard input too: after a piped document, none remain
        raise QspecError(
            "--document -: chat reads its questions from standard input, which already holds "
            "the document; pass the document as a file (or use qspec summarize -)"
        )
    params = _params(temperature, top_p, top_k)
    _check_mode(mode)
    drafts = _gamma(gamma)
    spec_gamma = drafts if mode == "quantspec" else None
    check_kv_group_size(group_size, gamma=spec_gamma)
    _check_run_options(dtype, threads, target_weights)
    if snapshot is not None:
        _input(snapshot)  # checks it is a readable snapshot before any model loads
    text = _read_text(document) if document is not None else None
    runtime = _load(
        model, dtype, threads, need_draft=mode == "quantspec", target_weights=target_weights
    )
    _check_group_size(group_size, runtime, spec_gamma)
    session = _session(
        snapshot,
        text,
        runtime,
        params=params,
        seed=seed,
        max_new_tokens=max_new_tokens,
        mode=mode,
        truncate=truncate,
        capacity=runtime.context_limit,
        gamma=drafts,
        group_size=group_size,
    )
    if session.truncated_tokens:
        _warn(f"document truncated: dropped its last {session.truncated_tokens} tokens")
    _log(f"{runtime.name} · mode {mode} · /exit /reset /stats · Ctrl-C stops an answer")
    progress = PrefillProgress(err)
    while True:
        try:
            question = out.input("[bold]> [/bold]").strip()
        except (EOFError, KeyboardInterrupt):
            out.print()
            return
        if not question:
            continue
        if question in ("/exit", "/quit"):
            return
        if question == "/reset":
            session.reset()
            _log("conversation cleared (the document stays loaded)")
            continue
        if question == "/stats":
            # totals hold every reply, stopped ones too; turns only the finished ones
            replies = session.turns + session.stopped
            out.print(stats_table(session.totals, session_title(replies, session.stopped)))
            continue
        reply = session.ask(question, on_prefill=progress)
        failed = False
        try:
            for piece in reply:
                out.out(piece, end="")
        except KeyboardInterrupt:
            reply.close()
            out.print("\n[yellow](stopped)[/yellow]", end="")
        except QspecError as e:
            failed = True
            _print_error(str(e))
        finally:
            progress.stop()
        if failed:
            continue
        out.print()
        out.print(stats_table(session.last, ""))


@app.command()
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
    model: ModelOpt = None,
    truncate: TruncOpt = False,
    group_size: GroupOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing snapshot.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    target_weights: TargetWeightsOpt = "full",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
):
    """Prefill a document once and save its hierarchical KV cache (a snapshot) to disk.

    Then `qspec chat SNAPSHOT` or `qspec summarize SNAPSHOT` answer without prefilling again,
    in this or another process, on this or another machine with the same model.
    """
    import time

    from qspec_cli.render import PrefillProgress
    from qspec_core.engine.session import SNAPSHOT_ANSWER_ROOM
    from qspec_core.store.snapshot import check_output, estimate_bytes, save_snapshot

    check_kv_group_size(group_size)
    _check_run_options(dtype, threads, target_weights)
    if is_stdin(file) and output is None:
        raise QspecError("a document read from standard input (-) needs -o/--output")
    output = output or file.with_suffix(".qspec")
    check_output(output, force)  # before the (long) prefill, and again with its size below
    text = _read_text(file)
    runtime = _load(model, dtype, threads, target_weights=target_weights)
    _check_group_size(group_size, runtime)
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
        _warn(f"document truncated: dropped its last {session.truncated_tokens} tokens")
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
    progress = PrefillProgress(err)
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
            "target_weights": target_weights,
        },
    )
    size = output.stat().st_size
    c = runtime.model.config
    bf16 = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * len(ids)
    if as_json:
        print(json.dumps({"output": str(output), "bytes": size, "bf16_kv_bytes": bf16, **manifest}))
        return
    out.print(
        Text(
            f"wrote {output}: {len(ids):,} tokens prefilled in {seconds:.1f} s "
            f"({len(ids) / seconds:,.0f} tok/s)"
        )
    )
    out.print(
        f"snapshot {size / 2**20:,.1f} MiB · a bf16 KV cache of the same tokens "
        f"{bf16 / 2**20:,.1f} MiB ({bf16 / size:.2f}x larger)"
    )


@app.command()
def info(
    snapshot: Annotated[Path, typer.Argument(help="A snapshot file (*.qspec).")],
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Show a snapshot's manifest and sizes, and whether it matches a model (--model, or the
    default model)."""
    from qspec_core.registry.sources import resolve_model
    from qspec_core.store.snapshot import model_fingerprint, tokenizer_fingerprint, verify_snapshot

    manifest = verify_snapshot(snapshot)  # every tensor's checksum: a flipped bit is refused
    folder = resolve_model(model, _log)
    checks = {
        "model": manifest["model_fingerprint"] == model_fingerprint(folder),
        "tokenizer": manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(folder),
    }
    size = snapshot.stat().st_size
    if as_json:
        print(
            json.dumps(
                {"bytes": size, "matches": checks, "checked_against": str(folder), **manifest}
            )
        )
        return
    from rich.table import Table

    table = Table(title=Text(str(snapshot)), title_justify="left", show_header=False)
    q = manifest["quantization"]
    rows = [
        ("model", manifest["model"]),
        ("created", f"{manifest['created']} with qspec {manifest['qspec_version']}"),
        ("format", f"{manifest['format']} v{manifest['format_version']}"),
        (
            "tokens",
            f"{manifest['tokens']:,} ({manifest['n_quant']:,} quantized, "
            f"{manifest['fp_len']:,} full precision)",
        ),
        (
            "quantization",
            f"INT4 upper + INT4 lower planes, G = {q['group_size']}, K "
            f"{q['key_grouping']}, V {q['value_grouping']}",
        ),
        ("size", f"{size / 2**20:,.2f} MiB"),
        ("document sha256", manifest["document_sha256"][:16] + "…"),
        (
            "matches " + str(folder.name),
            ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in checks.items()),
        ),
    ]
    for key, value in rows:
        table.add_row(Text(key), Text(str(value)))  # manifest values and names are not markup
    out.print(table)


@app.command()
def convert(
    model: Annotated[
        str | None,
        typer.Argument(help="Source model (folder, .gguf or hub id); default: the default model."),
    ] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write.")] = Path(
        "qspec-draft"
    ),
    method: Annotated[
        str, typer.Option(help="rtn (round to nearest), gptq or awq (both calibrated on --calib).")
    ] = "rtn",
    group_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Quantization group along in_features; default 128, or 64 where 128 does not "
            "divide every layer.",
        ),
    ] = None,
    calib: Annotated[
        Path | None,
        typer.Option(help="Calibration text (default: the bundled GPL-3.0 text; '-': stdin)."),
    ] = None,
    calib_tokens: Annotated[int, typer.Option(min=64, help="Calibration tokens to use.")] = 1024,
    draft_from: Annotated[
        str | None,
        typer.Option(
            help="Import the draft from a GPTQ or AWQ checkpoint (folder or hub id) instead."
        ),
    ] = None,
    export_gptq: Annotated[
        Path | None, typer.Option(help="Also write the draft as a standard GPTQ checkpoint folder.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    threads: ThreadsOpt = None,
):
    """Make a converted model: full-precision target weights plus 4-bit draft weights.

    Every linear layer (lm_head included) gets a 4-bit twin. The report gives each layer's
    relative weight error and, on the calibration text, the draft's top-1 agreement and KL
    against the target. Use the output with --model everywhere.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from qspec_core.convert.convert import convert as run_convert
    from qspec_core.convert.convert import export_gptq as run_export
    from qspec_core.registry.sources import resolve_model

    if draft_from is None and method not in ("rtn", "gptq", "awq"):
        raise QspecError(f"--method {method!r} is not available (have: rtn, gptq, awq)")
    _check_run_options("fp32", threads)
    calib_path = calib or Path(__file__).resolve().parent.parent / "qspec_core/data/gpl-3.0.txt"
    calib_text = _read_text(calib_path)
    runtime = _load(model, "fp32", threads)  # quantization math runs in fp32
    calib_ids = runtime.tokenizer.encode(calib_text)[:calib_tokens]
    draft_path = resolve_model(draft_from, _log) if draft_from else None
    n_layers = sum(1 for _ in runtime.model.modules() if type(_).__name__ == "Linear")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err,
        transient=True,
        disable=as_json,
    ) as progress:
        label = "import" if draft_path else f"{method} 4-bit"
        task = progress.add_task(
            f"{label} + INT8 verifier", total=n_layers * (1 if draft_path else 2)
        )
        report = run_convert(
            runtime.folder,
            output,
            runtime.model,
            method,
            group_size,
            calib_ids,
            str(calib_path),
            force,
            on_layer=lambda name: progress.advance(task),
            draft_from=draft_path,
        )
    exported = None
    if export_gptq is not None:
        config = json.loads((runtime.folder / "config.json").read_text())
        exported = run_export(runtime.model, config, export_gptq)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
            "special_tokens_map.json",
        ):
            if (runtime.folder / name).exists():  # a checkpoint folder others can load whole
                shutil.copy2(runtime.folder / name, exported / name)
        exported = str(exported)
    meta = json.loads((output / "qspec_draft.json").read_text())
    if as_json:
        print(json.dumps({"output": str(output), "exported_gptq": exported, **meta}))
        return
    errors = sorted(report.rel_weight_error.items(), key=lambda kv: -kv[1])
    out.print(
        Text(
            f"wrote {output} · {meta['method']} · group {meta['group_size']} · "
            f"{len(meta['modules'])} layers in 4 bits"
        )
    )
    out.print(
        Text(
            f"relative weight error: mean {sum(v for _, v in errors) / len(errors):.4f}, "
            f"worst {errors[0][1]:.4f} ({errors[0][0]})"
        )
    )
    if report.tokens:
        out.print(
            f"draft vs target on {min(report.tokens, 1024)} calibration tokens: top-1 "
            f"agreement {report.top1_agreement:.2%}, KL {report.kl:.4f} nats"
        )
    if exported:
        out.print(Text(f"GPTQ checkpoint: {exported}"))


@app.command()
def quality(
    file: Annotated[
        Path | None,
        typer.Argument(
            help="UTF-8 text to evaluate on ('-': standard input; default: the bundled "
            "Apache-2.0 licence text)."
        ),
    ] = None,
    model: ModelOpt = None,
    group_size: GroupOpt = None,
    max_tokens: Annotated[int, typer.Option(min=16, help="Evaluate on the first N tokens.")] = 2048,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
):
    """Measure the INT8 (target) and INT4 (draft) KV views against full precision.

    Perplexity, mean next-token KL and top-1 agreement on a real text, and KV bytes per token.
    """
    from qspec_core.bench.quality import measure_kv_quality

    check_kv_group_size(group_size)
    _check_run_options(dtype, threads)
    path = file or Path(__file__).resolve().parent.parent / "qspec_core/data/apache-2.0.txt"
    text = _read_text(path)
    runtime = _load(model, dtype, threads, need_draft=True)  # carries the INT8 weights
    _check_group_size(group_size, runtime)
    ids = runtime.tokenizer.encode(text)[:max_tokens]
    G = group_size or runtime.model.config.head_dim
    if len(ids) <= 2 * G:  # the KV of position p is quantized only up to (p // G - 1) * G
        raise QspecError(
            f"{'standard input' if is_stdin(path) else path}: {len(ids)} tokens, but with "
            f"G = {G} no KV is quantized before {2 * G + 1} tokens: use a longer text or "
            "a larger --max-tokens"
        )
    with err.status("measuring") as status:
        result = measure_kv_quality(
            runtime.model, ids, group_size, on_path=lambda p: status.update(f"path {p}")
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
    labels = {
        "target": "target (INT8)",
        "draft": "draft (INT4)",
        "w8": "INT8 weights, fp KV",
        "w8-target": "INT8 weights + INT8 KV",
    }
    for p, label in labels.items():
        if p not in result.perplexity:
            continue
        table.add_row(
            label,
            f"{result.perplexity[p]:.4f}",
            f"{result.kl_vs_fp[p]:.5f}",
            f"{result.top1_vs_fp[p]:.2%}",
            f"{result.bytes_per_token[p.removeprefix('w8-')]:,.0f}" if p != "w8" else "",
        )
    out.print(table)
    out.print(f"top-1 agreement draft vs target: {result.top1_draft_vs_target:.2%}")


@app.command()
def bench(
    model: ModelOpt = None,
    context: Annotated[
        str,
        typer.Option(
            help="Context sizes, comma-separated, k = 1024: the cache length at the end "
            "(a prompt of real text, then --gen new tokens)."
        ),
    ] = "2k,8k",
    gen: Annotated[int, typer.Option(min=2, help="Tokens decoded per run.")] = 128,
    modes: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated modes (default: all): ar (full-precision baseline), "
            "target-ar (INT8 KV), quantspec, draft-w4 (ablation: 4-bit weights, full KV), "
            "draft-kv4 (ablation: full weights, INT4 KV), ar-w8 (INT8 weights), "
            "quantspec-w8verify (INT8-weight verify)."
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per mode and context.")] = 3,
    gamma: GammaOpt = "4",
    temperature: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    group_size: GroupOpt = None,
    json_file: Annotated[
        Path | None,
        typer.Option("--json", help="Write every number to this JSON file ('-': stdout)."),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Draw tokens/s vs context and the stage shares to this PNG."),
    ] = None,
    warmup: Annotated[bool, typer.Option(help="One short unmeasured run per mode first.")] = True,
    target_weights: TargetWeightsOpt = "full",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
):
    """Benchmark QuantSpec against autoregressive decoding and two ablations, side by side.

    Modes run interleaved (A B C A B C ...) and report medians with min-max; the speedup over
    ar is taken pair-wise within each repeat. Ignores stop tokens: every run decodes --gen.
    """
    from qspec_cli.render import bench_tables
    from qspec_core.bench.runner import MODES as BENCH_MODES
    from qspec_core.bench.runner import (
        BenchConfig,
        needs_converted_model,
        parse_contexts,
        parse_modes,
        run_bench,
    )

    config = BenchConfig(
        contexts=parse_contexts(context),
        gen=gen,
        modes=parse_modes(modes),
        repeats=repeats,
        gamma=_gamma(gamma),
        params=_params(temperature, top_p, top_k),
        seed=seed,
        group_size=group_size,
        warmup=warmup,
        target_weights=target_weights,
    )
    # gamma meets G only where a speculative mode verifies on the hierarchical cache
    spec_gamma = next(
        (
            config.gamma
            for m in config.modes
            if BENCH_MODES[m].speculative and BENCH_MODES[m].cache == "hier"
        ),
        None,
    )
    check_kv_group_size(group_size, gamma=spec_gamma)
    _check_run_options(dtype, threads, target_weights)
    if json_file is not None and str(json_file) != "-":
        check_output_file(json_file, "--json")  # not after minutes of benchmarking
    if plot is not None:
        from qspec_cli.plot import check_plotting

        check_plotting(plot)
        check_output_file(plot, "--plot")
    # a named model's converted folder (made once) only when a mode needs the draft or INT8
    need = needs_converted_model(config)
    runtime = _load(model, dtype, threads, need_draft=need)  # bench toggles weights per mode
    _check_group_size(group_size, runtime, spec_gamma)
    with err.status("bench") as status:
        report = run_bench(
            runtime,
            config,
            str(runtime.model.dtype).removeprefix("torch."),
            on_run=lambda label: status.update(f"bench · {label}"),
        )
    if json_file is not None:
        text = json.dumps(report, indent=1)
        if str(json_file) == "-":
            print(text)
        else:
            from qspec_core.atomic_write import write_atomic

            write_atomic(json_file, lambda f: f.write((text + "\n").encode()), force=True)
    if json_file is None or str(json_file) != "-":
        # a pipe or file gets the whole table rather than 80 columns of truncated cells
        wide = out if out.is_terminal else Console(highlight=False, width=200)
        for table in bench_tables(report):
            wide.print(table)
            wide.print()
    if plot is not None:
        from qspec_cli.plot import plot_bench

        plot_bench(report, plot)
        err.print(Text(f"plot: {plot}"))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors are one line on stderr and exit code 2."""
    warnings.showwarning = _show_warning
    try:
        # standalone_mode=False: click's own errors (unknown option, bad value, missing
        # argument) reach us as exceptions instead of a multi-line box, and follow the same
        # contract; --help and --version come back as their exit code 0
        code = app(args=argv, prog_name="qspec", standalone_mode=False)
    except QspecError as e:
        _print_error(str(e))
        sys.exit(2)
    except typer.TyperException as e:  # click's ClickException and its UsageErrors
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `qspec`: the help is printed
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _print_error(e.format_message().rstrip(".") + hint)
        sys.exit(2)
    except typer.Abort:  # EOF at a prompt
        _print_error("aborted")
        sys.exit(1)
    except KeyboardInterrupt:
        code = 130
    if code == 130:  # click turns Ctrl-C into exit code 130
        _warn("interrupted")
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
