"""`qspec chat`: an interactive multi-turn chat over a document or a snapshot, streamed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qspec_cli import common
from qspec_core.documents import is_stdin
from qspec_core.errors import QspecError, user_errors

COMMANDS = {
    "/exit": "leave (also /quit, Ctrl-D)",
    "/reset": "clear the conversation; the document stays loaded",
    "/stats": "the session's totals: tokens, timings, acceptance",
    "/help": "this list",
}


def is_command(line: str) -> bool:
    """A line whose first word is a slash and letters (`/exti`) is meant as a command, never a
    question; a path (`/etc/hosts ...`) is a question."""
    word = line.split()[0]
    return len(word) > 1 and word[0] == "/" and word[1:].isalpha()


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
    model: common.ModelOpt = None,
    mode: common.ModeOpt = "quantspec",
    gamma: common.GammaOpt = "auto",
    lookup: common.LookupOpt = True,
    max_new_tokens: common.MaxNewOpt = 512,
    temperature: common.TempOpt = 0.0,
    top_p: common.TopPOpt = 1.0,
    top_k: common.TopKOpt = 0,
    seed: common.SeedOpt = 0,
    truncate: common.TruncOpt = False,
    group_size: common.GroupOpt = None,
    target_weights: common.TargetWeightsOpt = "auto",
    dtype: common.DtypeOpt = "auto",
    threads: common.ThreadsOpt = None,
):
    """Interactive multi-turn chat, streamed. Commands: /exit, /reset, /stats, /help.

    Ctrl-C stops the current answer and keeps the session; Ctrl-D or /exit leaves.
    """
    from qspec_cli.render import PrefillProgress, session_title, stats_table

    if sys.stdin is None:  # (fd 0 closed: `<&-`)
        raise QspecError(
            "standard input is closed: chat reads its questions from it; give it a terminal "
            "or a pipe (for one answer, use qspec summarize --prompt)"
        )
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
    params, drafts = common.check_session_options(
        mode, gamma, group_size, temperature, top_p, top_k, dtype, threads, target_weights
    )
    if snapshot is not None:
        common.read_input(snapshot)  # checks it is a readable snapshot before any model loads
    text = common.read_text(document) if document is not None else None
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
        common.warn(f"document truncated: dropped its last {session.truncated_tokens} tokens")
    common.log(f"{runtime.name} · mode {mode} · /help lists the commands · Ctrl-C stops an answer")
    out = common.out
    progress = PrefillProgress(common.err)
    while True:
        try:
            question = out.input("[bold]> [/bold]").strip()
        except (EOFError, KeyboardInterrupt):
            out.print()
            return
        except (OSError, ValueError, RuntimeError):  # standard input closed under us: its end
            out.print()
            return
        if not question:
            continue
        if question in ("/exit", "/quit"):
            return
        if question == "/help":
            for name, about in COMMANDS.items():
                out.print(f"{name:8s} {about}")
            continue
        if is_command(question) and question not in COMMANDS:
            common.warn(f"unknown command {question.split()[0]}; /help lists them")
            continue
        if question == "/reset":
            session.reset()
            common.log("conversation cleared (the document stays loaded)")
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
        except user_errors() as e:  # this answer failed; the session goes on
            failed = True
            common.print_error(str(e))
        finally:
            progress.stop()
        if failed:
            continue
        out.print()
        out.print(stats_table(session.last, ""))
