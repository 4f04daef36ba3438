"""Rich rendering of stats and progress; nothing here computes results.

Titles and cells that carry names from outside (model names and paths, CPU and GPU names,
modes read from a JSON report) are `Text`, never markup: `[/x]` in a name must print as is.
"""

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
from rich.text import Text

from qspec_core.engine.proposers import DraftSource
from qspec_core.engine.session import ReplyStats

PROGRESS_MIN_TOKENS = 1024  # shorter prefills finish before a bar is worth drawing
LOG_EVERY_S = 30.0  # where stderr is a file or a pipe: at most one progress line this often


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def snapshot_size_line(snapshot_bytes: int, bf16_bytes: int) -> str:
    """The snapshot's size beside a bf16 KV cache of the same tokens, the ratio always >= 1 and
    said of whichever is larger: a short document's snapshot can outweigh the cache."""
    line = (
        f"snapshot {snapshot_bytes / 2**20:,.1f} MiB · a bf16 KV cache of the same tokens "
        f"{bf16_bytes / 2**20:,.1f} MiB"
    )
    ratio = max(snapshot_bytes, bf16_bytes) / max(min(snapshot_bytes, bf16_bytes), 1)
    if f"{ratio:.2f}" == "1.00":
        return f"{line} (the same size)"
    if bf16_bytes > snapshot_bytes:
        return f"{line} ({ratio:.2f}x larger)"
    return f"{line} (the snapshot is {ratio:.2f}x larger)"


def session_title(answers: int, stopped: int = 0) -> str:
    """Title of chat's /stats table: the replies its totals add up."""
    return f"session · {plural(answers, 'answer')}" + (f" ({stopped:,} stopped)" if stopped else "")


def stats_table(stats: ReplyStats, title: str) -> Table:
    """One reply's (or a session's) stage timings; `title` is plain text, not markup."""
    table = Table(
        title=Text(title) if title else None,
        title_justify="left",
        show_edge=False,
        pad_edge=False,
    )
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
        if any(src.rounds for name, src in spec.by_source.items() if name != DraftSource.DRAFT):
            table.caption += "\n" + source_line(spec.sources())
        table.caption_justify = "left"
    return table


def source_line(sources: dict) -> str:
    """Acceptance per draft source: the 4-bit path, the document lookup, the document's
    token trees (tokens accepted of the nodes verified: a tree's alternatives cannot all be)."""
    parts = []
    for name, label in (
        (DraftSource.DRAFT, "4-bit drafts"),
        (DraftSource.LOOKUP, "document drafts"),
    ):
        src = sources[name]
        if src["drafted"]:
            parts.append(
                f"{label}: {src['accepted']}/{src['drafted']} accepted "
                f"({src['acceptance_rate']:.0%}) in {src['rounds']} rounds"
            )
    tree = sources.get(DraftSource.TREE)
    if tree and tree["rounds"]:
        parts.append(
            f"document trees: {tree['accepted']} tokens accepted of {tree['drafted']} nodes "
            f"in {tree['rounds']} rounds"
        )
    if plain := sources[DraftSource.NONE]["rounds"]:
        parts.append(f"{plain} plain target steps")
    return " · ".join(parts)


def progress(*columns, console: Console, disable: bool = False, **kwargs) -> Progress:
    """A transient bar on a terminal; elsewhere (a log file, a pipe: rich draws nothing there) a
    `LoggedProgress`, so an 11-minute conversion run under `nohup` still says where it is."""
    if disable or console.is_terminal:
        return Progress(*columns, console=console, transient=True, disable=disable, **kwargs)
    return LoggedProgress(*columns, console=console, **kwargs)


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LoggedProgress(Progress):
    """Plain lines instead of a bar: one every `LOG_EVERY_S` while a task runs, and a last one
    when a task that said anything (or ran that long) finishes; a shorter task stays silent."""

    def __init__(self, *columns, console: Console, **kwargs):
        super().__init__(*columns, console=console, transient=True, disable=True, **kwargs)
        self._said: dict = {}  # task id -> when its last line was printed

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log(task_id)

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._log(task_id)

    def _log(self, task_id) -> None:
        task, now = self._tasks[task_id], self.get_time()
        since = self._said.get(task_id, task.start_time)
        quiet_for = now - (now if since is None else since)
        if quiet_for < LOG_EVERY_S and not (task.finished and task_id in self._said):
            return
        self._said[task_id] = now
        line = f"{task.description}: {task.completed:,.0f}/{task.total:,.0f}"
        line += f" · {clock(task.finished_time or task.elapsed or 0)} elapsed"
        if not task.finished and task.time_remaining is not None:
            line += f" · eta {clock(task.time_remaining)}"
        line += "".join(f" · {v}" for v in task.fields.values() if str(v).strip("- "))
        self.console.print(Text(line), soft_wrap=True)


class PrefillProgress:
    """`on_prefill` callback for `ChatSession.ask`: a bar for long prefills, on stderr."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None

    def __call__(self, total: int) -> Callable[[int], None] | None:
        if total < PROGRESS_MIN_TOKENS:
            return None
        self.progress = progress(
            TextColumn("prefill"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=self.console,
        )
        task = self.progress.add_task("prefill", total=total, rate="- tok/s")
        self.progress.start()

        def advance(n: int) -> None:
            self.progress.advance(task, n)
            t = self.progress.tasks[0]
            speed = t.finished_speed or t.speed
            self.progress.update(task, rate=f"{speed:,.0f} tok/s" if speed else "- tok/s")
            if t.finished:
                self.stop()

        return advance

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _size(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def bench_tables(report: dict) -> list[Table]:
    """`qspec bench`'s report: one table of rates per context, one of the stage breakdown."""
    m, cfg = report["machine"], report["config"]
    gpu = f" · {m['gpu']}" if m["gpu"] else ""
    gpu += f" · INT8 prefill {m['int8_prefill']}" if m.get("int8_prefill") else ""
    products = m.get("prefill_products")
    gpu += f" · attention products {products}" if products and products != "fp32" else ""
    header = (
        f"{report['model']} · {m['dtype']} · {m['cpu']}, {m['threads']} threads{gpu} · torch "
        f"{m['torch']} · gen {cfg['gen']} · gamma {cfg['gamma']} · T {cfg['temperature']} · "
        f"G {cfg['group_size']} · {cfg['repeats']} interleaved repeats: medians (min-max)"
    )
    tables = []
    for ctx in report["contexts"]:
        table = Table(
            title=f"context {_size(ctx['context'])} ({ctx['prompt_tokens']:,} prompt tokens)",
            title_justify="left",
            caption=Text(
                header + "\nKV B/token: bytes read per history token, all layers (draft / target;"
                " a sliding-window layer's history is at most its window)"
                "\ndoc rounds: rounds drafted from the prompt (lookup), of all; their acceptance;"
                " + rounds of the prompt's token trees"
            ),
            caption_justify="left",
            show_edge=False,
            pad_edge=False,
        )
        columns = ("mode", "prefill tok/s", "TTFT s", "decode tok/s", "range", "ms/token",
                   "vs ar", "accept", "tok/step", "doc rounds", "KV B/token")  # fmt: skip
        for col in columns:
            table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
        for name, r in ctx["modes"].items():
            spec = r.get("spec")
            speed = r["speedup_vs_ar"]
            rate = r["decode_tokens_per_s"]
            table.add_row(
                Text(name),
                f"{r['prefill_tokens_per_s']['median']:,.0f}",
                f"{r['ttft_s']['median']:.2f}",
                f"{rate['median']:.2f}",
                f"{rate['min']:.2f}-{rate['max']:.2f}",
                f"{r['ms_per_token']['median']:.1f}",
                f"{speed['median']:.2f}x" if speed else "",
                f"{spec['acceptance_rate']:.0%}" if spec else "",
                f"{spec['tokens_per_target_step']:.2f}" if spec else "",
                _lookup_cell(spec),
                " / ".join(f"{v:,.0f}" for v in r["kv_bytes_per_token"].values()),
            )
        tables.append(table)
        tables.append(_stage_table(ctx))
        if report.get("read_bandwidth_gb_s"):
            tables.append(_traffic_table(ctx, report["read_bandwidth_gb_s"]))
        if report.get("gemm_peak_gflop_s"):
            tables.append(_compute_table(ctx, report["gemm_peak_gflop_s"]))
    return tables


def _compute_table(ctx: dict, peaks: dict) -> Table:
    """Per mode: the prefill's FLOPs (linears, attention), its rate, and that rate against the
    best GEMM this run measured; then each stage's rate against it (linears: the time outside
    attention and quantization) and the quantization's seconds."""
    probe = " · ".join(f"{k} {v:,.0f}" for k, v in peaks.items() if v)
    table = Table(
        title=f"context {_size(ctx['context'])} · prefill against the compute limit "
        f"(GEMM GFLOP/s measured in this run: {probe})",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
    )
    columns = ("mode", "GFLOP linears", "GFLOP attention", "GFLOP/s", "of best peak",
               "linears GFLOP/s", "attention GFLOP/s", "quantize s", "other s")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for name, r in ctx["modes"].items():
        c = r.get("prefill_compute")
        if c:
            table.add_row(
                Text(name), f"{c['gflop_linears']:,.1f}", f"{c['gflop_attention']:,.1f}",
                f"{c['gflop_s']:,.1f}", _share(c["fraction_of_peak"]),
                _stage(c, "linears"), _stage(c, "attention"),
                f"{c['quantize_s']:.2f}" if "quantize_s" in c else "",
                f"{c['other_s']:.2f}" if "other_s" in c else "",
            )  # fmt: skip
    return table


def _share(fraction: float | None) -> str:
    return f"{fraction:.0%}" if fraction else ""


def _stage(line: dict, name: str) -> str:
    """A prefill stage's GFLOP/s and its share of the best peak: '84.2 (21%)'."""
    rate = line.get(f"{name}_gflop_s")
    if rate is None:
        return ""
    share = _share(line.get(f"{name}_fraction_of_peak"))
    return f"{rate:,.1f} ({share})" if share else f"{rate:,.1f}"


def _lookup_cell(spec: dict | None) -> str:
    """Rounds drafted from the document, of all, and their drafts' acceptance."""
    if not spec:
        return ""
    lookup = spec["sources"][DraftSource.LOOKUP]
    trees = spec["sources"].get(DraftSource.TREE, {}).get("rounds", 0)
    more = f" +{trees} trees" if trees else ""
    if not lookup["rounds"]:
        return f"0{more}"
    return f"{lookup['rounds']}/{spec['rounds']} ({lookup['acceptance_rate']:.0%}){more}"


def _traffic_table(ctx: dict, gb_s: float) -> Table:
    """Per step kind: time, bytes it must read, and that rate against the measured bandwidth."""
    table = Table(
        title=f"context {_size(ctx['context'])} · steps against the memory limit "
        f"(read bandwidth measured in this run: {gb_s:.1f} GB/s)",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
    )
    for col in ("mode", "step", "weights", "steps", "ms/step", "MB read/step", "GB/s", "of limit"):
        table.add_column(col, justify="left" if col in ("mode", "step", "weights") else "right")
    for name, r in ctx["modes"].items():
        for kind, s in r.get("steps", {}).items():
            rate = s["mb_read"] / s["ms"] if s["ms"] else 0.0  # MB/ms = GB/s
            share = s["fraction_of_bandwidth"]
            table.add_row(
                Text(name), kind, s["weights"], f"{s['steps']}", f"{s['ms']:.2f}",
                f"{s['mb_read']:.1f}", f"{rate:.1f}", f"{share:.0%}" if share else "",
            )  # fmt: skip
    return table


def _stage_table(ctx: dict) -> Table:
    stages = sorted({s for r in ctx["modes"].values() for s in r["stages"]}, key=_stage_key)
    table = Table(
        title=f"context {_size(ctx['context'])} · where decoding time goes: seconds (share)",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("mode")
    for s in stages:
        table.add_column(Text(s), justify="right")
    for name, r in ctx["modes"].items():
        cells = []
        for s in stages:
            st = r["stages"].get(s)
            cells.append(f"{st['seconds']:.2f} ({st['share']:.0%})" if st else "")
        table.add_row(Text(name), *cells)
    return table


def _stage_key(name: str) -> tuple[int, str]:
    order = ("decode", "draft", "verify", "accept", "rollback", "rotate")
    return (order.index(name) if name in order else len(order), name)
