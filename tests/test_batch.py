"""Batches of documents (`qspec summarize FILE|DIR... -o out.jsonl`, `qspec_core/batch/`): the
inputs, the JSONL log (whole records, torn tails, one writer), resume, and the executors
(this process, local workers, Ray) giving the same greedy text, through a worker's kill -9."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_qspec
from hypothesis import given, settings
from hypothesis import strategies as st

from qspec_core.batch.inputs import expand_inputs
from qspec_core.batch.job import BatchSettings
from qspec_core.batch.records import RECORD_START, RecordLog, new_record
from qspec_core.batch.run import content_sha256, plan
from qspec_core.errors import QspecError

# ----------------------------------------------------------------------------- inputs


def test_folders_expand_to_their_text_files_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    for name in ("b/2.md", "a.txt", "b/1.rst", "skip.bin", ".hidden.txt", ".git/x.txt"):
        (tmp_path / name).write_text("x")
    os.symlink(tmp_path, tmp_path / "b" / "loop")  # a folder reached twice is read once
    named = tmp_path / "named.data"  # a file named on the command line: taken as it is
    named.write_text("y")
    got = expand_inputs([tmp_path, named, tmp_path / "a.txt"])
    rel = [str(p.relative_to(tmp_path)) for p in got]
    assert rel == ["a.txt", "b/1.rst", "b/2.md", "named.data"]
    with pytest.raises(QspecError, match="no such file or folder"):
        expand_inputs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(QspecError, match="no text files"):
        expand_inputs([tmp_path / "empty"])


# ----------------------------------------------------------------------------- the log


def _record(i, **kw):
    return new_record(f"doc{i}.txt", "k", sha256=f"{i:064x}", **kw)


def test_records_append_whole_and_reopen(tmp_path):
    out = tmp_path / "out.jsonl"
    with RecordLog(out) as log:
        log.append(_record(1, text="één"))
        log.append(_record(2, error="bad"))
    with RecordLog(out) as log:
        assert [r["path"] for r in log.records] == ["doc1.txt", "doc2.txt"]
        assert log.succeeded(f"{1:064x}", "k")["text"] == "één"
        assert log.succeeded(f"{2:064x}", "k") is None  # an error is not done
        assert log.succeeded(f"{1:064x}", "other settings") is None
        assert log.repaired_bytes == 0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 4), cut=st.integers(0, 10_000), text=st.text(max_size=30))
def test_a_torn_tail_is_dropped_and_whole_records_kept(tmp_path_factory, n, cut, text):
    out = tmp_path_factory.mktemp("log") / "out.jsonl"
    with RecordLog(out) as log:
        for i in range(n):
            log.append(_record(i, text=text))
    data = out.read_bytes()
    cut = cut % (len(data) + 1)
    out.write_bytes(data[:cut])  # a crash anywhere in the last writes
    whole = data[:cut].count(b"\n")
    with RecordLog(out) as log:
        assert [r["path"] for r in log.records] == [f"doc{i}.txt" for i in range(whole)]
        assert log.repaired_bytes == cut - (data[:cut].rfind(b"\n") + 1)
        log.append(_record(9))
    assert out.read_bytes().endswith(b'"settings_key": "k"}\n')
    assert all(line.startswith(RECORD_START) for line in out.read_bytes().splitlines())
    assert len(out.read_bytes().splitlines()) == whole + 1


def test_a_file_that_is_not_a_batch_log_is_left_alone(tmp_path):
    for content in ("notes\nmore notes\n", "# a single line without a newline", "[1, 2]\n"):
        out = tmp_path / "out.jsonl"
        out.write_text(content)
        with pytest.raises(QspecError, match="not a qspec batch record"):
            RecordLog(out).open()
        assert out.read_text() == content
    with pytest.raises(QspecError, match="is a folder"):
        RecordLog(tmp_path).open()
    with pytest.raises(QspecError, match="does not exist"):
        RecordLog(tmp_path / "no" / "out.jsonl").open()


def test_one_writer_at_a_time(tmp_path):
    out = tmp_path / "out.jsonl"
    with RecordLog(out):
        with pytest.raises(QspecError, match="another qspec batch is writing"):
            RecordLog(out).open()
    with RecordLog(out):  # released on close
        pass


def test_plan_skips_only_same_content_and_settings_that_succeeded(tmp_path):
    docs = [tmp_path / f"{i}.txt" for i in range(4)]
    for i, d in enumerate(docs):
        d.write_text(f"document {i}")
    s = BatchSettings(max_new_tokens=8)
    with RecordLog(tmp_path / "out.jsonl") as log:
        log.append(new_record("x", s.key(), sha256=content_sha256(docs[0])))
        log.append(new_record("y", "old", sha256=content_sha256(docs[1])))
        log.append(new_record("z", s.key(), sha256=content_sha256(docs[2]), error="e"))
        todo, skipped = plan(docs, log, s)
        assert skipped == docs[:1] and todo == docs[1:]
        docs[0].write_text("changed")
        assert plan(docs, log, s)[1] == []
    assert BatchSettings(prompt="other").key() != BatchSettings().key()


# ----------------------------------------------------------------------------- end to end

GEN = ("--max-new-tokens", "12", "--truncate")


@pytest.fixture
def folder(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    words = "river stone lamp orchard violin harbor"
    for i in range(5):
        text = f"Report {i}. " + " ".join(words.split()[i:] + words.split()[:i]) * (3 + i)
        (docs / ("sub" if i % 2 else ".") / f"r{i}.txt").write_text(text + "\n")
    (docs / "empty.md").write_text("   \n")  # fails: recorded, and the batch goes on
    return docs


@pytest.fixture
def many(tmp_path):
    """Enough documents that a worker is still busy when one is killed."""
    docs = tmp_path / "many"
    docs.mkdir()
    for i in range(40):
        (docs / f"d{i:02d}.txt").write_text(f"Note {i}: " + "the mill by the river " * (5 + i % 7))
    return docs


def _records(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def _texts(out):
    return {r["path"].rsplit("/", 1)[-1]: r.get("text") for r in _records(out)}


def test_a_batch_records_every_document_and_resumes(tiny_model_dir, folder, tmp_path):
    out = tmp_path / "out.jsonl"
    run = run_qspec("summarize", folder, "-o", out, "--model", tiny_model_dir, *GEN, "--json")
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("error:") == 1 and "empty.md" in run.stderr
    summary = json.loads(run.stdout)
    assert summary["summarized"] == 5 and len(summary["failed"]) == 1
    records = _records(out)
    assert len(records) == 6 and sum("error" in r for r in records) == 1
    ok = [r for r in records if "error" not in r]
    assert all(r["new_tokens"] > 0 and len(r["sha256"]) == 64 for r in ok)
    assert all(r["sha256"] == content_sha256(r["path"]) for r in ok)
    # a torn last line (kill -9 mid-write) is repaired; only the failed document is retried
    with open(out, "ab") as f:
        f.write(RECORD_START + b'"half')
    (folder / "empty.md").write_text("Now it has words in it.\n")
    again = run_qspec("summarize", folder, "-o", out, "--model", tiny_model_dir, *GEN)
    assert again.returncode == 0, again.stderr
    assert "torn" in again.stderr and "5 of 6 documents already done" in again.stderr
    records = _records(out)
    assert len(records) == 7 and "error" not in records[-1]
    assert records[-1]["path"].endswith("empty.md")


def test_batch_input_errors_are_one_line(tiny_model_dir, folder, tmp_path):
    out = tmp_path / "out.jsonl"
    cases = [
        (["summarize", folder], "add -o"),
        (["summarize", folder / "r0.txt", folder / "r2.txt"], "add -o"),
        (["summarize", folder / "r0.txt", "--workers", "2"], "--workers is for batches"),
        (["summarize", folder, "-o", out, "--workers", "999"], "--workers must be"),
        (["summarize", folder, "-o", tmp_path], "is a folder"),
        (["summarize", folder, "-o", out, "--snapshots", folder / "r0.txt"], "takes a folder"),
        (["summarize", tmp_path / "nope", "-o", out], "no such file or folder"),
    ]
    for args, words in cases:
        run = run_qspec(*args, "--model", tiny_model_dir)
        assert run.returncode == 2 and run.stderr.count("error:") == 1, (args, run.stderr)
        assert words in run.stderr, (args, run.stderr)
    assert not out.exists() or out.read_text() == ""


def test_workers_give_the_same_text_and_survive_a_kill(tiny_model_dir, many, tmp_path):
    one = tmp_path / "one.jsonl"
    run = run_qspec("summarize", many, "-o", one, "--model", tiny_model_dir, *GEN)
    assert run.returncode == 0, run.stderr
    two = tmp_path / "two.jsonl"
    cmd = [sys.executable, "-m", "qspec_cli.app", "summarize", str(many), "-o", str(two)]
    cmd += ["--model", str(tiny_model_dir), *GEN, "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = _kill_a_worker(proc.pid, two)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert killed, "no worker was found to kill"
    assert _texts(two) == _texts(one)  # every document, the same greedy text


def _kill_a_worker(parent: int, out, timeout=120) -> bool:
    """kill -9 one worker process of `parent` once it is running (the model loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = subprocess.run(
            ["pgrep", "-P", str(parent)], capture_output=True, text=True
        ).stdout.split()
        workers = [int(c) for c in children if "spawn_main" in _cmdline(int(c))]
        if workers and out.exists() and out.read_text().count("\n") >= 1:
            os.kill(workers[0], signal.SIGKILL)
            return True
        time.sleep(0.05)
    return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_snapshots_skip_the_prefill_for_another_prompt(tiny_model_dir, folder, tmp_path):
    snaps = tmp_path / "snaps"
    base = ["--model", tiny_model_dir, *GEN, "--snapshots", snaps]
    first = run_qspec("summarize", folder, "-o", tmp_path / "a.jsonl", *base)
    assert first.returncode == 2, first.stderr
    assert len(list(snaps.glob("*.qspec"))) == 5
    ask = ("--prompt", "List the words.")
    second = run_qspec("summarize", folder, "-o", tmp_path / "b.jsonl", *base, *ask)
    records = [r for r in _records(tmp_path / "b.jsonl") if "error" not in r]
    assert len(records) == 5 and all(r["snapshot"]["loaded"] for r in records), second.stderr
    plain = run_qspec(
        "summarize", folder, "-o", tmp_path / "c.jsonl", "--model", tiny_model_dir, *GEN, *ask
    )
    assert plain.returncode == 2
    assert _texts(tmp_path / "b.jsonl") == _texts(tmp_path / "c.jsonl")
    # a damaged snapshot is a cache miss: made again, and the document still summarized
    victim = sorted(snaps.glob("*.qspec"))[0]
    victim.write_bytes(victim.read_bytes()[:1000])
    third = run_qspec("summarize", folder, "-o", tmp_path / "d.jsonl", *base, *ask)
    records = [r for r in _records(tmp_path / "d.jsonl") if "error" not in r]
    replaced = [r for r in records if "replaced" in r["snapshot"]]
    assert len(records) == 5 and len(replaced) == 1, third.stderr
    assert _texts(tmp_path / "d.jsonl") == _texts(tmp_path / "c.jsonl")


def test_ray_local_gives_the_same_text_and_survives_a_kill(tiny_model_dir, many, tmp_path):
    pytest.importorskip("ray")
    one = tmp_path / "one.jsonl"
    run_qspec("summarize", many, "-o", one, "--model", tiny_model_dir, *GEN)
    out = tmp_path / "ray.jsonl"
    cmd = [sys.executable, "-m", "qspec_cli.app", "summarize", str(many), "-o", str(out)]
    cmd += ["--model", str(tiny_model_dir), *GEN, "--ray", "local", "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = _kill_a_ray_actor(out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert killed, "no Ray actor was found to kill"
    assert _texts(out) == _texts(one)


def _kill_a_ray_actor(out, timeout=300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = subprocess.run(
            ["pgrep", "-f", "ray::_Summarizer"], capture_output=True, text=True
        ).stdout.split()
        if pids and out.exists() and out.read_text().count("\n") >= 1:
            os.kill(int(pids[0]), signal.SIGKILL)
            return True
        time.sleep(0.05)
    return False


@pytest.mark.real_model
def test_workers_equal_one_process_on_the_real_model(default_converted, tmp_path):
    """The default model (W8A8 target, quantspec): two workers with one thread each give the
    text of one process with two threads, document by document."""
    from conftest import DATA

    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("apache-2.0.txt", "mpl-2.0.txt", "cc0-1.0.txt"):
        (docs / name).write_text((DATA / name).read_text()[:3000])
    gen = ("--max-new-tokens", "32")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    first = run_qspec("summarize", docs, "-o", one, *gen, "--threads", "2")
    assert first.returncode == 0, first.stderr
    second = run_qspec("summarize", docs, "-o", two, *gen, "--workers", "2")
    assert second.returncode == 0, second.stderr
    texts = _texts(one)
    assert len(texts) == 3 and all(texts.values()) and _texts(two) == texts
    assert all(r["mode"] == "quantspec" and r["stats"]["rounds"] for r in _records(two))
