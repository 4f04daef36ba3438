"""Progress where stderr is not a terminal (a log file, a pipe: rich draws no bar there): a
long task prints a plain line now and then and a last one, a short one prints nothing."""

import io

from rich.console import Console

from qspec_cli import common, render


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _log_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=40), buffer


def test_a_long_task_says_where_it_is_in_plain_lines():
    console, buffer = _log_console()
    clock = Clock()
    with render.progress(console=console, get_time=clock) as bar:
        assert isinstance(bar, render.LoggedProgress)
        task = bar.add_task("layers", total=4, rate="")
        for step in range(4):
            clock.now += render.LOG_EVERY_S * 0.6  # a line every other step
            bar.update(task, advance=1, rate=f"{step} tok/s")
    lines = buffer.getvalue().splitlines()
    # (not wrapped at the console's 40 columns: one line each, as a log reader greps them)
    assert lines == [
        "layers: 2/4 · 0:00:36 elapsed · eta 0:00:36 · 1 tok/s",
        "layers: 4/4 · 0:01:12 elapsed · 3 tok/s",
    ]


def test_a_short_task_stays_silent():
    console, buffer = _log_console()
    clock = Clock()
    with render.progress(console=console, get_time=clock) as bar:
        task = bar.add_task("layers", total=3)
        for _ in range(3):
            clock.now += render.LOG_EVERY_S / 4
            bar.advance(task)
    assert buffer.getvalue() == ""


def test_a_terminal_gets_the_bar_and_disable_prints_nothing():
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert not isinstance(render.progress(console=terminal), render.LoggedProgress)
    console, buffer = _log_console()
    with render.progress(console=console, disable=True) as bar:
        task = bar.add_task("layers", total=1)
        bar.advance(task)
    assert not isinstance(bar, render.LoggedProgress) and buffer.getvalue() == ""


def test_convert_steps_and_prefills_log_off_a_terminal(monkeypatch):
    """`convert`'s per-layer progress and a long prefill's, with stderr a file."""
    console, buffer = _log_console()
    monkeypatch.setattr(common, "err", console)
    monkeypatch.setattr(render, "LOG_EVERY_S", 0.0)
    with common.step_progress("RTN 4-bit draft + INT8 verifier") as start:
        on_layer = start(2)
        on_layer()
        on_layer()
    prefill = render.PrefillProgress(console)
    advance = prefill(render.PROGRESS_MIN_TOKENS)
    advance(render.PROGRESS_MIN_TOKENS)
    text = buffer.getvalue()
    assert "RTN 4-bit draft + INT8 verifier: 1/2" in text
    assert "RTN 4-bit draft + INT8 verifier: 2/2" in text
    assert f"prefill: {render.PROGRESS_MIN_TOKENS:,}/{render.PROGRESS_MIN_TOKENS:,}" in text
