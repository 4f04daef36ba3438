"""A full disk (ENOSPC) or a spent quota (EDQUOT) wherever qspec writes: one `error:` line that
names the disk, exit code 2, nothing half-written, and a rerun after freeing space finishes
the work. The refusals are simulated (a tmpfs would need root and a mount)."""

import errno
import os

import pytest
from test_cli_input import assert_one_error, qspec

from qspec_core import atomic_write
from qspec_core.batch import records
from qspec_core.batch.records import RECORD_START, RecordLog, new_record
from qspec_core.convert.folder import staged_folder
from qspec_core.errors import QspecError


def _full(path="") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.fixture
def disk_fills_at_record(monkeypatch):
    """`fill(n)`: the n-th record line written from now on (1-based) gets half its bytes out,
    then ENOSPC, as a disk that fills mid-record would; `fill(None)` frees the space."""
    real_write = os.write
    state = {"left": None}

    def write(fd, data):
        if state["left"] is not None and bytes(data[: len(RECORD_START)]) == RECORD_START:
            state["left"] -= 1
            if state["left"] == 0:
                real_write(fd, bytes(data[: len(data) // 2]))
                raise _full()
        return real_write(fd, data)

    monkeypatch.setattr(records.os, "write", write)

    def fill(n):
        state["left"] = n

    return fill


def test_a_full_disk_mid_record_leaves_the_log_whole(tmp_path, disk_fills_at_record):
    out = tmp_path / "b.jsonl"
    with RecordLog(out) as log:
        log.append(new_record(tmp_path / "a.txt", "k", text="first"))
        whole = out.read_bytes()
        disk_fills_at_record(1)
        with pytest.raises(QspecError, match="the disk is full") as refused:
            log.append(new_record(tmp_path / "b.txt", "k", text="second " * 50))
        assert str(out) in str(refused.value) and "mounted at /" in str(refused.value)
        assert out.read_bytes() == whole and len(log.records) == 1
        disk_fills_at_record(None)
        log.append(new_record(tmp_path / "c.txt", "k", text="third"))
    with RecordLog(out) as again:
        assert [r["text"] for r in again.records] == ["first", "third"]
        assert again.repaired_bytes == 0


def test_a_batch_on_a_full_disk_stops_with_one_line_and_resumes(
    capsys, tiny_model_dir, tmp_path, disk_fills_at_record
):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"The keeper of harbour {i} counted {40 + i} ships.\n")
    out = tmp_path / "b.jsonl"
    args = ["summarize", folder, "-o", out, "--model", tiny_model_dir, "--mode", "target-ar"]
    args += ["--max-new-tokens", "3", "--json"]
    disk_fills_at_record(2)
    result = qspec(capsys, *args)
    assert_one_error(result, f"cannot write {out}: the disk is full", "free some space")
    assert out.read_bytes().count(b"\n") == 1 and out.read_bytes().endswith(b"}\n")
    disk_fills_at_record(None)
    result = qspec(capsys, *args)
    assert result.code == 0, result.err
    paths = [line.split(b'"path": ')[1].split(b",")[0] for line in out.read_bytes().splitlines()]
    assert len(paths) == 3 and len(set(paths)) == 3  # every document once


def test_a_snapshot_on_a_full_disk_names_the_disk_and_leaves_nothing(tmp_path):
    def write(f):
        f.write(b"half a snapshot")
        raise _full()

    target = tmp_path / "s.qspec"
    with pytest.raises(QspecError, match=f"cannot write {target}: the disk is full"):
        atomic_write.write_atomic(target, write, force=False)
    assert list(tmp_path.iterdir()) == []


def test_a_quota_is_named_too(tmp_path):
    def write(f):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    with pytest.raises(QspecError, match="the disk quota is used up"):
        atomic_write.write_atomic(tmp_path / "s.qspec", write, force=False)


def test_a_converted_folder_on_a_full_disk_leaves_nothing(tmp_path):
    out = tmp_path / "converted"
    with pytest.raises(QspecError, match=f"cannot write {out}: the disk is full"):
        with staged_folder(tmp_path, out) as tmp:
            (tmp / "draft.safetensors").write_bytes(b"half")
            raise _full(tmp / "draft.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_anywhere_else_is_one_line(capsys, tmp_path, monkeypatch):
    """Any write the sites above do not cover (a cache file, the kernels' build folder)."""
    from qspec_core import paths

    def full_home():
        raise _full(tmp_path / "home" / "x")

    monkeypatch.setattr(paths, "check_home", full_home)
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted 41 ships.\n")
    result = qspec(capsys, "summarize", doc)
    assert_one_error(result, f"cannot write {tmp_path / 'home' / 'x'}: the disk is full")


def test_the_kernel_build_on_a_full_disk_is_refused_not_worked_around(tmp_path, monkeypatch):
    """A compiler that ran out of room: an OSError of the build folder (the CLI's one line
    above), not a warning and the slow PyTorch paths."""
    from kernels.cpu import build

    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))

    def compile_full(isa, name, folder):
        raise RuntimeError(
            "Error building extension 'x': fatal error: error writing to "
            f"{folder}/x.o: No space left on device"
        )

    with pytest.raises(OSError) as refused:
        build._build("generic", compile=compile_full)
    assert refused.value.errno == errno.ENOSPC
    assert refused.value.filename == str(build.build_folder("generic"))
