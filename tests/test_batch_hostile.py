"""Batches against hostile inputs: file names that are not UTF-8, a JSONL file that is not a
batch log, FIFOs and other special files where a document is expected, and a Ray address
that cannot be joined. Each case once hung, crashed or wrote where it should not."""

import base64
import json
import os
import signal
import socket
import time

import pytest
from conftest import run_qspec

from qspec_core.batch.records import RECORD_START, RecordLog, new_record, path_bytes
from qspec_core.batch.run import content_sha256
from qspec_core.documents import read_document
from qspec_core.errors import QspecError

GEN = ("--max-new-tokens", "4", "--mode", "target-ar")
ODD = b"n\xff\xfename.txt"  # not UTF-8: Python holds it as lone surrogates


def _records(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def _one_error_line(run):
    return run.returncode == 2 and run.stderr.count("error:") == 1


# ----------------------------------------------------------------------------- file names


def test_a_name_that_is_not_utf8_is_recorded_exactly(tmp_path):
    path = os.fsdecode(os.fsencode(tmp_path) + b"/" + ODD)
    out = tmp_path / "out.jsonl"
    with RecordLog(out) as log:
        log.append(new_record(path, "k", error=f"{path}: is empty"))
        log.append(new_record(tmp_path / "plain.txt", "k"))
    odd, plain = _records(out)  # (read back as UTF-8: valid JSON text)
    assert path_bytes(odd) == os.fsencode(path) and odd["path"].endswith("n\\xff\\xfename.txt")
    assert base64.b64decode(odd["path_b64"]).endswith(ODD)
    assert "path_b64" not in plain and path_bytes(plain) == os.fsencode(tmp_path / "plain.txt")
    assert odd["error"].endswith("n\\xff\\xfename.txt: is empty")


def test_a_batch_over_a_name_that_is_not_utf8_records_it_and_resumes(tiny_model_dir, tmp_path):
    mix = tmp_path / "mix"
    mix.mkdir()
    for name in (b"a.txt", ODD, b"z.txt"):
        with open(os.fsencode(mix) + b"/" + name, "w") as f:
            f.write(f"The keeper of {name!r} counted 41 ships.\n")
    out = tmp_path / "mix.jsonl"
    run = run_qspec("summarize", mix, "-o", out, "--model", tiny_model_dir, *GEN, "--json")
    assert run.returncode == 0, run.stderr
    records = _records(out)
    assert len(records) == 3 and not any("error" in r for r in records)
    names = sorted(path_bytes(r).rsplit(b"/", 1)[-1] for r in records)
    assert names == [b"a.txt", ODD, b"z.txt"]
    again = run_qspec("summarize", mix, "-o", out, "--model", tiny_model_dir, *GEN)
    assert again.returncode == 0 and "3 of 3 documents already done" in again.stderr
    assert len(_records(out)) == 3


# ----------------------------------------------------------------------------- the log


def test_a_foreign_jsonl_is_refused_untouched(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted 41 ships.\n")
    inv = tmp_path / "inv.jsonl"
    for content in (b'{"path": "/etc/hosts", "size": 5}\n', b'{"path": 1}\n{"path": 2}\n'):
        inv.write_bytes(content)
        os.utime(inv, ns=(1_000_000_000, 1_000_000_000))
        run = run_qspec("summarize", doc, "-o", inv, "--model", tiny_model_dir, *GEN)
        assert _one_error_line(run), run.stderr
        assert inv.read_bytes() == content and inv.stat().st_mtime_ns == 1_000_000_000


def test_only_tagged_records_make_a_log(tmp_path):
    out = tmp_path / "out.jsonl"
    foreign = [
        b'{"qspec_batch": 2, "path": "x"}\n',  # a later version: not ours to append to
        b'{"qspec_batch": 1}\n',
        RECORD_START + b'"x"}\n{"path": "y"}\n',
        b'{"path": "/etc/hosts"',  # a torn last line must look like ours too
    ]
    for content in foreign:
        out.write_bytes(content)
        with pytest.raises(QspecError, match="not a qspec batch record|earlier qspec|later qspec"):
            RecordLog(out).open()
        assert out.read_bytes() == content
    out.write_bytes(b"")  # an empty file is adopted
    with RecordLog(out) as log:
        log.append(new_record("a.txt", "k"))
    assert out.read_bytes().startswith(RECORD_START)


def test_a_log_of_the_previous_version_is_refused_with_a_way_on(tmp_path):
    """qspec's first batch format had no tag: refused (never guessed), and the message gives
    the command that tags it; after it, the log resumes."""
    out = tmp_path / "old.jsonl"
    old = [{"path": "a.txt", "sha256": "0" * 64, "settings_key": "k", "text": '{"path": '}]
    content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in old).encode()
    out.write_bytes(content)
    with pytest.raises(QspecError, match="earlier qspec") as info:
        RecordLog(out).open()
    assert out.read_bytes() == content
    assert "sed -i" in str(info.value)
    fixed = content.replace(b'{"path": ', RECORD_START, 1)  # what the sed line does
    out.write_bytes(fixed)
    with RecordLog(out) as log:
        assert log.succeeded("0" * 64, "k")["text"] == '{"path": '


# ----------------------------------------------------------------------------- FIFOs


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "doc.txt"
    os.mkfifo(path)  # nobody ever writes to it: opening it plainly would wait for ever
    return path


@pytest.fixture
def deadline():
    """A blocked open fails the test after 20 s instead of hanging the suite (PEP 475: the
    alarm's exception ends the retried system call)."""

    def expired(*_):
        raise TimeoutError("blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_special_files_are_refused_without_blocking(fifo, tmp_path, deadline):
    with pytest.raises(QspecError, match="is a FIFO, not a regular file"):
        read_document(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.txt"))
    with pytest.raises(QspecError, match="is a socket, not a regular file"):
        read_document(tmp_path / "sock.txt")
    sock.close()
    assert content_sha256(fifo) is None


@pytest.mark.parametrize("command", ["summarize", "prefill", "chat"])
def test_commands_refuse_a_fifo_in_one_line(tiny_model_dir, fifo, tmp_path, command):
    args = {
        "summarize": [fifo],
        "prefill": [fifo, "-o", tmp_path / "s.qspec"],
        "chat": ["--document", fifo],
    }[command]
    run = run_qspec(command, *args, "--model", tiny_model_dir, timeout=60)
    assert _one_error_line(run) and "is a FIFO" in run.stderr, run.stderr


def test_a_batch_reports_special_files_as_failed(tiny_model_dir, fifo, tmp_path):
    (tmp_path / "ok.txt").write_text("The keeper counted 41 ships.\n")
    out = tmp_path / "out.jsonl"
    for inputs in ([tmp_path], [fifo, tmp_path / "ok.txt"]):  # found in a folder, or named
        out.unlink(missing_ok=True)
        args = [*inputs, "-o", out, "--model", tiny_model_dir, *GEN, "--json"]
        run = run_qspec("summarize", *args, timeout=120)
        assert _one_error_line(run), run.stderr
        failed = json.loads(run.stdout)["failed"]
        assert [f["path"] for f in failed] == [str(fifo)] and "is a FIFO" in failed[0]["error"]
        assert sum("error" not in r for r in _records(out)) == 1


# ----------------------------------------------------------------------------- Ray


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_a_failed_ray_join_creates_nothing_and_says_so_briefly(tiny_model_dir, tmp_path, address):
    pytest.importorskip("ray")
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted 41 ships.\n")
    out, snaps = tmp_path / "out.jsonl", tmp_path / "snaps"
    start = time.monotonic()
    args = [doc, "-o", out, "--snapshots", snaps, "--ray", address, "--model", tiny_model_dir]
    run = run_qspec("summarize", *args, timeout=120)
    assert _one_error_line(run) and "127.0.0.1:1" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) <= 2, run.stderr  # where Ray's log is, the error
    assert time.monotonic() - start < 60
    assert not out.exists() and not snaps.exists()


# ----------------------------------------------------------------------------- links and paths


def test_dangling_links_and_link_loops_are_recorded_as_failed(tiny_model_dir, tmp_path):
    from qspec_core.batch.inputs import expand_inputs

    folder = tmp_path / "links"
    folder.mkdir()
    (folder / "good.txt").write_text("The keeper counted 41 ships.\n")
    (folder / "dangling.txt").symlink_to(folder / "gone.txt")
    (folder / "loop.txt").symlink_to(folder / "loop.txt")
    assert [p.name for p in expand_inputs([folder])] == ["dangling.txt", "good.txt", "loop.txt"]
    out = tmp_path / "links.jsonl"
    run = run_qspec("summarize", folder, "-o", out, "--model", tiny_model_dir, *GEN)
    assert _one_error_line(run) and "2 of 3 documents failed" in run.stderr, run.stderr
    errors = {r["path"].rsplit("/", 1)[1]: r.get("error") for r in _records(out)}
    assert errors["good.txt"] is None
    assert "a symlink to nothing" in errors["dangling.txt"]
    assert "a symlink loop" in errors["loop.txt"]


def test_one_file_under_two_paths_is_one_document(tmp_path):
    from qspec_core.batch.inputs import expand_inputs

    folder = tmp_path / "bw"
    folder.mkdir()
    (folder / "doc1.txt").write_text("The keeper counted 41 ships.\n")
    (folder / "doc2.txt").write_text("The keeper counted 42 ships.\n")
    (tmp_path / "alias.txt").symlink_to(folder / "doc2.txt")
    twice = [folder / "doc1.txt", folder / ".." / "bw" / "doc1.txt", folder, tmp_path / "alias.txt"]
    assert expand_inputs(twice) == [folder / "doc1.txt", folder / "doc2.txt"]


def test_a_log_of_a_later_qspec_says_so(tmp_path):
    out = tmp_path / "later.jsonl"
    content = b'{"qspec_batch": 2, "path": "a.txt", "sha256": null}\n'
    out.write_bytes(content)
    with pytest.raises(QspecError, match="written by a later qspec .batch format 2"):
        RecordLog(out).check()
    assert out.read_bytes() == content


def test_an_output_below_a_file_says_the_file_is_in_the_way(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder\n")
    for out in (blocker / "b.jsonl", blocker / "deeper" / "b.jsonl"):
        with pytest.raises(QspecError, match=f"{blocker} is a file, not a folder"):
            RecordLog(out).check()
