"""Rich rendering of stats and progress; nothing here computes results."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from qspec_core.session import ReplyStats

PROGRESS_MIN_TOKENS = 1024  # shorter prefills finish before a bar is worth drawing


def stats_table(stats: ReplyStats, title: str) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("tokens/s", justify="right")
    counts = {"prefill": stats.prefilled_tokens, "decode": stats.new_tokens}
    for stage, seconds in stats.timings_s.items():
        n = counts.get(stage)
        rate = f"{n / seconds:,.1f}" if n and seconds > 0 else ""
        table.add_row(stage, f"{seconds:.3f}", "" if n is None else f"{n:,}", rate)
    decode_s = stats.generation_s
    if stats.spec is not None and decode_s > 0:  # quantspec: the stages add up to decoding
        table.add_row(
            "[bold]generation[/bold]",
            f"{decode_s:.3f}",
            f"{stats.new_tokens:,}",
            f"{stats.new_tokens / decode_s:,.1f}",
        )
        spec = stats.spec
        table.caption = (
            f"acceptance {spec.acceptance_rate:.0%} · {spec.tokens_per_target_step:.2f} tokens "
            f"per target step · {spec.rounds} rounds: {spec.accepted} accepted, "
            f"{spec.recovered} recovered, {spec.bonus} bonus"
        )
        table.caption_justify = "left"
    return table


class PrefillProgress:
    """`on_prefill` callback for `ChatSession.ask`: a bar for long prefills, on stderr."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None

    def __call__(self, total: int) -> Callable[[int], None] | None:
        if total < PROGRESS_MIN_TOKENS or not self.console.is_terminal:
            return None
        self.progress = Progress(
            TextColumn("prefill"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} tok/s"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        task = self.progress.add_task("prefill", total=total, rate="-")
        self.progress.start()

        def advance(n: int) -> None:
            self.progress.advance(task, n)
            t = self.progress.tasks[0]
            speed = t.finished_speed or t.speed
            self.progress.update(task, rate=f"{speed:,.0f}" if speed else "-")
            if t.finished:
                self.stop()

        return advance

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
