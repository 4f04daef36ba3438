"""Snapshot outputs: what may be overwritten, exactly one writer wins a race, checks before the
prefill, and stray temporary files after kill -9. Small random caches (test_snapshot.py's
helpers), no runtime."""

import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_snapshot import (
    DOC,
    SMALL,
    SMALL_G,
    SMALL_TOKENS,
    TESTS,
    fake_model_folder,
    save_small,
    small_cache,
)

from qspec_cli.render import snapshot_size_line
from qspec_core import atomic_write
from qspec_core.errors import QspecError
from qspec_core.store import snapshot as snap


@pytest.fixture
def model_folder(tmp_path):
    return fake_model_folder(tmp_path / "model")


# ------------------------------------------------------- what may be overwritten (defect 1)
def _special_files(tmp_path):
    """A FIFO always; a character device (/dev/null's numbers) where mknod is permitted."""
    fifo = tmp_path / "fifo.qspec"
    os.mkfifo(fifo)
    nodes = [fifo]
    try:
        os.mknod(tmp_path / "null.qspec", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        nodes.append(tmp_path / "null.qspec")
    except OSError:
        pass  # not root, or no CAP_MKNOD: the FIFO covers the same code path
    return nodes


def test_force_never_replaces_a_device_or_fifo(tmp_path, model_folder):
    for node in _special_files(tmp_path):
        kind = stat.S_IFMT(node.lstat().st_mode)
        for force in (False, True):
            with pytest.raises(QspecError, match="not a regular file"):
                save_small(node, model_folder, force=force)
            with pytest.raises(QspecError, match="not a regular file"):
                snap.check_output(node, force)
        assert stat.S_IFMT(node.lstat().st_mode) == kind  # still the node it was
    with pytest.raises(QspecError, match="is a folder"):
        save_small(model_folder, model_folder, force=True)


def test_symlinks_only_to_a_regular_file_are_replaced_and_only_the_link(tmp_path, model_folder):
    target = tmp_path / "target.qspec"
    target.write_bytes(b"keep me")
    link = tmp_path / "link.qspec"
    link.symlink_to(target)
    with pytest.raises(QspecError, match="--force"):
        save_small(link, model_folder)
    save_small(link, model_folder, force=True)
    assert not link.is_symlink() and snap.verify_snapshot(link)["tokens"] == SMALL_TOKENS
    assert target.read_bytes() == b"keep me"  # the link was replaced, not what it pointed to
    (tmp_path / "to-fifo.qspec").symlink_to(_special_files(tmp_path)[0])
    (tmp_path / "dangling.qspec").symlink_to(tmp_path / "nothing")
    for name in ("to-fifo.qspec", "dangling.qspec"):
        with pytest.raises(QspecError, match="symlink"):
            save_small(tmp_path / name, model_folder, force=True)
        assert (tmp_path / name).is_symlink()


# ------------------------------------------------------- exactly one writer wins (defect 2)
RACER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_snapshot import save_small
from qspec_core.errors import QspecError

out, model, go, seed = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
fsync = os.fsync
def slow_fsync(fd):  # a slow disk: both racers are past any existence check when publishing
    time.sleep(0.5)
    fsync(fd)
os.fsync = slow_fsync
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
try:
    save_small(out, model, seed=seed)
    print("won", seed)
except QspecError as e:
    print("error:", e)
"""


def test_two_processes_racing_for_one_output_exactly_one_wins(tmp_path, model_folder):
    out, go = tmp_path / "out" / "s.qspec", tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(TESTS), str(out), str(model_folder), str(go), s],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in ("1", "2")
    ]
    for racer in racers:
        assert racer.stdout.readline().strip() == "ready"
    go.touch()
    results = [racer.communicate(timeout=120) for racer in racers]
    lines = [stdout.strip() for stdout, _ in results]
    assert all(r.returncode == 0 for r in racers), [err for _, err in results]
    assert sorted(line.split()[0] for line in lines) == ["error:", "won"], lines
    assert "exists; pass --force" in next(line for line in lines if line.startswith("error"))
    winner = int(next(line for line in lines if line.startswith("won")).split()[1])
    manifest = snap.verify_snapshot(out)  # whole, and the winner's bytes
    fp_k = small_cache(winner).state()["fp_k"]
    assert manifest["tensor_sha256"]["fp_k"] == snap._tensor_sha(fp_k)
    assert os.listdir(out.parent) == ["s.qspec"]  # the loser left no temporary file


@pytest.mark.parametrize("hard_links", [True, False])
def test_racing_threads_exactly_one_wins(tmp_path, model_folder, monkeypatch, hard_links):
    """The same race in one process, also where the filesystem has no hard links (the
    O_EXCL reservation fallback)."""
    if not hard_links:

        def no_link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(atomic_write.os, "link", no_link)
    both_written = threading.Barrier(2, timeout=30)
    write = snap._write_file

    def meeting_write(f, prefix, tensors):
        write(f, prefix, tensors)
        both_written.wait()

    monkeypatch.setattr(snap, "_write_file", meeting_write)
    out, outcomes = tmp_path / "s.qspec", []

    def race(cache):
        try:
            save_small(out, model_folder, cache=cache)
            outcomes.append("won")
        except QspecError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=race, args=(small_cache(s),)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == [f"{out} exists; pass --force to overwrite it", "won"]
    snap.verify_snapshot(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "s.qspec"]
    monkeypatch.setattr(snap, "_write_file", write)
    save_small(out, model_folder, force=True)  # force still replaces, links or not
    snap.verify_snapshot(out)


# ------------------------------------------------------- checks before the prefill (defect 3)
def test_check_output_refuses_early_and_creates_nothing(tmp_path, model_folder):
    out = tmp_path / "new" / "deeper" / "s.qspec"
    snap.check_output(out, force=False, need_bytes=1)
    assert not (tmp_path / "new").exists()  # probed, then removed
    save_small(out, model_folder)
    with pytest.raises(QspecError, match="exists; pass --force"):
        snap.check_output(out, force=False)
    snap.check_output(out, force=True)
    assert os.listdir(out.parent) == ["s.qspec"]
    (tmp_path / "file.txt").write_text("x")
    for below_a_file in (tmp_path / "file.txt" / "s.qspec", tmp_path / "file.txt" / "a" / "s"):
        with pytest.raises(QspecError, match="is a file, not a folder"):
            snap.check_output(below_a_file, force=True)
        with pytest.raises(QspecError, match="is a file, not a folder"):
            save_small(below_a_file, model_folder, force=True)
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(QspecError, match="MiB free, the output needs about"):
        snap.check_output(tmp_path / "big.qspec", force=False, need_bytes=free + 2**40)


def test_check_output_in_a_folder_root_cannot_write():
    """Root writes almost anywhere; sysfs refuses even root (EACCES, EPERM)."""
    try:
        os.close(os.open("/sys/qspec-probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        os.unlink("/sys/qspec-probe")
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    with pytest.raises(QspecError, match="/sys is not writable"):
        snap.check_output(Path("/sys/s.qspec"), force=False)
    with pytest.raises(QspecError, match="cannot be created"):
        snap.check_output(Path("/sys/qspec-new-folder/s.qspec"), force=False)


def test_check_output_probes_with_a_real_file(read_only_tmp):
    """os.access says yes to root; what matters is whether a create succeeds (here: a
    read-only mount, simulated, since root cannot be denied in a plain folder)."""
    tmp_path = read_only_tmp
    with pytest.raises(QspecError, match="is not writable .Read-only file system"):
        snap.check_output(tmp_path / "s.qspec", force=False)


def test_disk_full_during_the_write_is_a_user_error_and_leaves_nothing(
    tmp_path, model_folder, monkeypatch
):
    def disk_full(f, prefix, tensors):
        f.write(prefix)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(snap, "_write_file", disk_full)
    with pytest.raises(QspecError, match="cannot write .*No space left on device"):
        save_small(tmp_path / "out" / "s.qspec", model_folder)
    assert os.listdir(tmp_path / "out") == []


def test_estimate_bytes_is_close_to_the_real_size(tmp_path, model_folder):
    save_small(tmp_path / "s.qspec", model_folder)
    estimate = snap.estimate_bytes(SMALL, SMALL_TOKENS, SMALL_G, torch.float32, len(DOC))
    assert 0 <= estimate - (tmp_path / "s.qspec").stat().st_size <= 64 * 1024


# ------------------------------------------------------- strays after kill -9 (defect 4)
KILLED = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_snapshot import save_small

def hang(fd):  # the bytes are written; block where a slow disk would
    print("writing", flush=True)
    time.sleep(120)

os.fsync = hang
save_small(Path(sys.argv[2]), Path(sys.argv[3]))
"""


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_kill_9_leaves_one_temp_file_that_the_next_write_removes(tmp_path, model_folder):
    out = tmp_path / "out" / "s.qspec"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(TESTS), str(out), str(model_folder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "writing"
    child.kill()
    child.wait()
    strays = os.listdir(out.parent)
    host = atomic_write._host()
    assert len(strays) == 1 and strays[0].startswith(f".s.qspec.{host}.{child.pid}."), strays
    save_small(out, model_folder)
    assert os.listdir(out.parent) == ["s.qspec"]


def test_only_dead_writers_temp_files_are_removed(tmp_path, model_folder):
    host, dead, live = atomic_write._host(), _dead_pid(), os.getpid()
    names = {
        "dead": f".s.qspec.{host}.{dead}.0123abcd.tmp",
        "live": f".s.qspec.{host}.{live}.0123abcd.tmp",
        "other output": f".t.qspec.{host}.{dead}.0123abcd.tmp",
        "other host": f".s.qspec.elsewhere.{dead}.0123abcd.tmp",
        "not ours": ".s.qspec.tmpab12cd",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    snap.check_output(tmp_path / "s.qspec", force=False)
    assert not (tmp_path / names["dead"]).exists()
    assert all((tmp_path / names[k]).exists() for k in names if k != "dead")
    (tmp_path / names["dead"]).write_bytes(b"partial")
    save_small(tmp_path / "s.qspec", model_folder)
    assert not (tmp_path / names["dead"]).exists()
    assert (tmp_path / names["live"]).exists()


def test_size_comparison_is_worded_from_the_larger_side():
    mib = 2**20
    # the usual case, a long document: the bf16 cache is the larger
    assert snapshot_size_line(mib, 4 * mib).endswith("4.0 MiB (4.00x larger)")
    # a short document: the snapshot is the larger, and must not read "0.50x larger"
    line = snapshot_size_line(2 * mib, mib)
    assert line.endswith("(the snapshot is 2.00x larger)") and "0.50x" not in line
    assert snapshot_size_line(mib, mib).endswith("(the same size)")
