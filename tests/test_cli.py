"""The CLI on bad input: one line, exit code 2, no traceback, nothing written."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import DATA, run_qspec


def assert_user_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr  # one line, always
    for word in words:
        assert word in proc.stderr


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


def _bad_files(tmp):
    (tmp / "empty.txt").write_text("  \n")
    (tmp / "binary.bin").write_bytes(b"\x7fELF\x00\x01\x02" * 20)
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp / "folder").mkdir()
    return {
        "missing": (tmp / "nope.txt", "no such file"),
        "empty": (tmp / "empty.txt", "only whitespace"),
        "binary": (tmp / "binary.bin", "binary"),
        "latin1": (tmp / "latin1.txt", "not UTF-8"),
        "folder": (tmp / "folder", "folder"),
    }


@pytest.mark.parametrize("kind", ["missing", "empty", "binary", "latin1", "folder"])
def test_bad_documents(workdir, kind, tiny_model_dir):
    path, message = _bad_files(workdir)[kind]
    before = sorted(p.name for p in workdir.iterdir())
    proc = run_qspec("summarize", path, "--model", tiny_model_dir, cwd=workdir)
    assert_user_error(proc, message)
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_unreadable_document(workdir, tiny_model_dir):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = workdir / "secret.txt"
    path.write_text("hello")
    path.chmod(0)
    assert_user_error(run_qspec("summarize", path, "--model", tiny_model_dir), "cannot read")


def test_unknown_model(workdir):
    doc = workdir / "doc.txt"
    doc.write_text("Some text.")
    assert_user_error(
        run_qspec("summarize", doc, "--model", workdir / "no-such-model"), "not found"
    )


def test_corrupt_checkpoint(workdir, tiny_model_dir):
    import shutil

    broken = workdir / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    doc = workdir / "doc.txt"
    doc.write_text("Some text.")
    assert_user_error(run_qspec("summarize", doc, "--model", broken), "corrupt checkpoint")


def test_document_longer_than_context(workdir, tiny_model_dir):
    doc = workdir / "long.txt"
    doc.write_text((DATA / "apache-2.0.txt").read_text())  # ~2.3k tokens > 512
    proc = run_qspec("summarize", doc, "--model", tiny_model_dir, "--max-new-tokens", "8")
    assert_user_error(proc, "context is 512 tokens", "--truncate")
    proc = run_qspec(
        "summarize", doc, "--model", tiny_model_dir, "--max-new-tokens", "8", "--truncate", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["truncated_tokens"] > 1000


def test_bad_option_values(workdir, tiny_model_dir):
    doc = workdir / "doc.txt"
    doc.write_text("Some text.")
    proc = run_qspec("summarize", doc, "--model", tiny_model_dir, "--mode", "warp")
    assert_user_error(proc, "mode 'warp'")
    proc = run_qspec("summarize", doc, "--model", tiny_model_dir, "--top-p", "0")
    assert_user_error(proc, "top_p")


def test_chat_commands(tiny_model_dir, workdir):
    doc = workdir / "doc.txt"
    doc.write_text("The keeper counted 41 ships.")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qspec_cli.app",
            "chat",
            "--document",
            str(doc),
            "--model",
            str(tiny_model_dir),
            "--max-new-tokens",
            "5",
        ],
        input="How many ships?\n/stats\n/reset\nAgain?\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"session · 1 answer\s*$", proc.stdout, re.M)  # singular
    assert proc.stdout.count("prefill") >= 3  # two answers' tables and /stats
    assert "tokens per target" in proc.stdout  # quantspec is the default mode


def test_version():
    proc = run_qspec("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("qspec 0.")


def test_help_explains():
    proc = run_qspec("summarize", "--help")
    assert proc.returncode == 0
    for option in ("--model", "--max-new-tokens", "--temperature", "--truncate", "--json"):
        assert option in proc.stdout
