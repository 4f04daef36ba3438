"""Standard streams and `qspec chat`'s input: a closed standard input is refused before
anything loads (chat's questions come from there), so is a closed standard output, and a chat
line that looks like a command but is none is not sent to the model as a question."""

import io
import subprocess
import sys

import pytest
from test_cli_input import assert_one_error, qspec

from qspec_cli import common


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The keeper counted 41 ships in the harbour.\n")
    return path


def test_a_closed_stdin_is_refused_before_the_model_loads(capsys, doc, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded (and the document prefilled) first")

    monkeypatch.setattr(common, "load", load)
    monkeypatch.setattr(sys, "stdin", None)  # (what Python makes of a closed fd 0)
    for args in (["--document", doc], [doc.with_suffix(".qspec")], ["--document", "-"]):
        assert_one_error(qspec(capsys, "chat", *args), "standard input is closed")


def test_a_closed_stdin_in_a_real_process(tiny_model_dir, doc):
    command = f"{sys.executable} -m qspec_cli.app chat --document {doc} --model {tiny_model_dir}"
    run = subprocess.run(
        ["bash", "-c", command + " <&-"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: standard input is closed: chat reads its questions from it; give it a "
        "terminal or a pipe (for one answer, use qspec summarize --prompt)"
    ]


def test_unknown_commands_are_not_questions(capsys, tiny_model_dir, doc, monkeypatch, spy):
    from qspec_core.engine import session

    asked = spy(session.ChatSession, "ask")
    lines = "/unknowncmd\n/exti\n/help\n/etc/hosts is a path, not a command?\n/exit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    args = ["chat", "--document", doc, "--model", tiny_model_dir, "--mode", "target-ar"]
    result = qspec(capsys, *args, "--max-new-tokens", "2")
    assert result.code == 0, result.err
    assert "unknown command /unknowncmd; /help lists them" in result.err
    assert "unknown command /exti; /help lists them" in result.err
    for command in ("/exit", "/reset", "/stats", "/help"):
        assert command in result.out  # (the /help list)
    assert asked == ["ask"]  # the path question only


def test_a_closed_stdout_is_refused_before_anything_runs(doc):
    """The results go to standard output: with it closed (`>&-`) a run would be lost."""
    command = f"{sys.executable} -m qspec_cli.app summarize {doc} --model /nonexistent"
    run = subprocess.run(
        ["bash", "-c", command + " >&-"], capture_output=False, stderr=subprocess.PIPE,
        text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: standard output is closed: qspec writes its results there; redirect it to a "
        "file (or /dev/null)"
    ]


def test_a_full_stdout_is_one_line_that_names_no_disk(tmp_path, doc, monkeypatch, capsys):
    """A write without a file name (standard output on /dev/full) names no mount point."""
    import errno
    import os

    from qspec_core import paths

    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(paths, "check_home", full)
    result = qspec(capsys, "summarize", doc)
    assert_one_error(result, "a write failed: No space left on device")
    assert "mounted at" not in result.err
