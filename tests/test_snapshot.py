"""Snapshots: round trip, mismatch detection, corruption, atomic writes, fresh-process load.

Most robustness tests use a small cache filled with random KV (`small_cache`) and a fake model
folder: no runtime, milliseconds per snapshot. tests/test_snapshot_fuzz.py reuses them.
"""

import errno
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import DATA

from qspec_core import atomic_write
from qspec_core.store import snapshot as snap
from qspec_core.config import ModelConfig
from qspec_core.errors import QspecError
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.registry.runtime import load_runtime
from qspec_core.engine.session import ChatSession

DOC = "The lighthouse keeper counted 41 ships in March and 17 in April. " * 6
TESTS = Path(__file__).resolve().parent
SMALL = ModelConfig(
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16
)
SMALL_TOKENS, SMALL_G = 37, 8


def small_cache(seed: int = 0) -> HierarchicalKVCache:
    """A committed cache of SMALL_TOKENS random positions (24 quantized, 13 full precision)."""
    cache = HierarchicalKVCache(SMALL, 64, SMALL_G)
    gen = torch.Generator().manual_seed(seed)
    shape = (SMALL.num_hidden_layers, 1, SMALL.num_key_value_heads, SMALL_TOKENS, SMALL.head_dim)
    cache.load_full_precision(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return cache


def fake_model_folder(folder: Path) -> Path:
    """What the fingerprints read: config.json and a weights file (no tokenizer files)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


class StubModel(torch.nn.Module):
    """All load_snapshot asks of a model: config, dtype, device, no int8 linear layers."""

    def __init__(self):
        super().__init__()
        self.config, self.dtype, self.device = SMALL, torch.float32, "cpu"


def save_small(path: Path, model_folder: Path, force: bool = False, seed: int = 0, cache=None):
    cache = cache or small_cache(seed)
    ids = list(range(SMALL_TOKENS))
    return snap.save_snapshot(path, cache, ids, DOC, model_folder, "small", force)


def load_small(path: Path, model_folder: Path):
    return snap.load_snapshot(path, model_folder, StubModel(), 64, SMALL_G)


@pytest.fixture
def model_folder(tmp_path):
    return fake_model_folder(tmp_path / "model")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None)


def _make(runtime, path, document=DOC, group_size=None, **kw):
    session = ChatSession(runtime, document, mode="target-ar", group_size=group_size)
    cache, ids = session.prefill_document()
    return snap.save_snapshot(path, cache, ids, session.document, runtime.folder, "tiny", **kw)


def _answer(session, question):
    return "".join(session.ask(question))


@pytest.mark.parametrize("mode", ["quantspec", "target-ar"])
def test_chat_from_snapshot_equals_chat_from_document(tiny, tmp_path, mode):
    path = tmp_path / "doc.qspec"
    _make(tiny, path)
    loaded = snap.load_snapshot(path, tiny.folder, tiny.model, tiny.context_limit)
    from_snapshot = ChatSession(tiny, loaded.document, mode=mode, max_new_tokens=16)
    from_snapshot.adopt_cache(loaded.cache, loaded.token_ids)
    direct = ChatSession(tiny, DOC, mode=mode, max_new_tokens=16)
    for question in ("How many ships?", "And in April?"):
        assert _answer(from_snapshot, question) == _answer(direct, question)
    assert from_snapshot.totals.prefilled_tokens < direct.totals.prefilled_tokens


def test_overwrite_needs_force(tiny, tmp_path):
    path = tmp_path / "doc.qspec"
    _make(tiny, path)
    with pytest.raises(QspecError, match="--force"):
        _make(tiny, path)
    _make(tiny, path, force=True)


def test_mismatches_are_named(tiny, tmp_path, tiny_model_dir):
    path = tmp_path / "doc.qspec"
    _make(tiny, path)
    model = tiny.model
    # another model: same architecture, one weight changed
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QspecError, match="another model"):
        snap.load_snapshot(path, other, model, 512)
    # another tokenizer / chat template
    retok = tmp_path / "retok"
    shutil.copytree(tiny_model_dir, retok)
    (retok / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with pytest.raises(QspecError, match="tokenizer"):
        snap.load_snapshot(path, retok, model, 512)
    # another quantization setting
    with pytest.raises(QspecError, match="group size 16, this run 8"):
        snap.load_snapshot(path, tiny.folder, model, 512, group_size=8)


def _rewrite_manifest(path, edit, fix_checksum):
    """Edit the JSON manifest inside the safetensors header, keeping the file valid."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["manifest"])
    edit(manifest)
    if fix_checksum:
        manifest["manifest_sha256"] = snap._manifest_sha(manifest)
    header["__metadata__"]["manifest"] = json.dumps(manifest)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_corruption_is_detected(tiny, tmp_path):
    path = tmp_path / "doc.qspec"
    _make(tiny, path)
    good = path.read_bytes()
    # truncated
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(QspecError, match="truncated or corrupt"):
        snap.load_snapshot(path, tiny.folder, tiny.model, 512)
    # one flipped bit in the tensor data (the last byte: inside the last tensor)
    flipped = bytearray(good)
    flipped[-1] ^= 0x10
    path.write_bytes(bytes(flipped))
    with pytest.raises(QspecError, match="checksum mismatch in tensor"):
        snap.load_snapshot(path, tiny.folder, tiny.model, 512)
    # an edited manifest
    path.write_bytes(good)
    _rewrite_manifest(path, lambda m: m.update(n_quant=0), fix_checksum=False)
    with pytest.raises(QspecError, match="manifest was modified"):
        snap.load_snapshot(path, tiny.folder, tiny.model, 512)
    # a future format version (manifest consistent)
    path.write_bytes(good)
    _rewrite_manifest(path, lambda m: m.update(format_version=99), fix_checksum=True)
    with pytest.raises(QspecError, match="format version 99"):
        snap.load_snapshot(path, tiny.folder, tiny.model, 512)
    # not a snapshot at all
    path.write_bytes(b"hello")
    with pytest.raises(QspecError, match="truncated or corrupt"):
        snap.read_manifest(path)


def test_interrupted_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    path = tmp_path / "doc.qspec"

    def failing_write(f, prefix, tensors):
        f.write(b"partial")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr(snap, "_write_file", failing_write)
    with pytest.raises(KeyboardInterrupt):
        _make(tiny, path)
    assert list(tmp_path.iterdir()) == []  # no snapshot, no temporary file
    monkeypatch.undo()
    _make(tiny, path)  # and a later write still works
    shutil.copy(path, tmp_path / "copy.qspec")
    _make(tiny, path, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.qspec", "doc.qspec"]


def test_cli_prefill_then_chat_in_a_fresh_process(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    run = [sys.executable, "-m", "qspec_cli.main"]
    proc = subprocess.run(
        run + ["prefill", str(doc), "--model", str(tiny_model_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["output"].endswith("doc.qspec") and result["bytes"] > 0
    doc.unlink()  # the snapshot must not need the document
    chat = subprocess.run(
        run
        + [
            "chat",
            str(tmp_path / "doc.qspec"),
            "--model",
            str(tiny_model_dir),
            "--max-new-tokens",
            "4",
        ],
        input="How many ships?\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert chat.returncode == 0, chat.stderr
    assert "tokens per target" in chat.stdout
    info = subprocess.run(
        run + ["info", str(tmp_path / "doc.qspec"), "--model", str(tiny_model_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(info.stdout)["matches"] == {"model": True, "tokenizer": True}
    again = subprocess.run(
        run + ["prefill", str(tmp_path / "doc.qspec")], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 2 and "error:" in again.stderr


def test_truncated_snapshot_leaves_room_for_the_answer(tiny_model_dir, tmp_path):
    """`prefill --truncate` of a document longer than the context: the snapshot keeps room
    for a question and an answer (half the tiny model's 512 tokens), and summarize uses it
    as is, with or without --truncate (which must not cut the snapshot's document again)."""
    from qspec_cli.main import main

    doc = tmp_path / "big.txt"
    doc.write_text(DOC * 20)  # ~1.6k tokens
    model = ["--model", str(tiny_model_dir)]
    with pytest.raises(SystemExit) as done:
        main(["prefill", str(doc), "--truncate", *model, "--json"])
    assert done.value.code in (0, None)
    snapshot = str(tmp_path / "big.qspec")
    manifest = snap.read_manifest(tmp_path / "big.qspec")
    assert manifest["tokens"] <= 512 - 256
    for extra in ([], ["--truncate"]):
        with pytest.raises(SystemExit) as done:
            main(["summarize", snapshot, *model, "--max-new-tokens", "200", "--json", *extra])
        assert done.value.code in (0, None), extra


@pytest.mark.real_model
def test_real_model_snapshot_round_trip(tmp_path):
    """Greedy, real model, quantspec: the same answer from the snapshot and the document."""
    text = (DATA / "apache-2.0.txt").read_text()[:4000]
    runtime = load_runtime(None, dtype="fp32", log=lambda m: None, need_draft=True)
    path = tmp_path / "apache.qspec"
    session = ChatSession(runtime, text, mode="quantspec")
    cache, ids = session.prefill_document()
    snap.save_snapshot(path, cache, ids, session.document, runtime.folder, runtime.name)
    loaded = snap.load_snapshot(path, runtime.folder, runtime.model, runtime.context_limit)
    a = ChatSession(runtime, loaded.document, mode="quantspec", max_new_tokens=24)
    a.adopt_cache(loaded.cache, loaded.token_ids)
    b = ChatSession(runtime, text, mode="quantspec", max_new_tokens=24)
    question = "What may a contributor not do?"
    assert _answer(a, question) == _answer(b, question)
    assert a.last.prefilled_tokens < 30 < b.last.prefilled_tokens
    assert torch.equal(torch.tensor(a._cached_ids), torch.tensor(b._cached_ids))


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


def test_check_output_probes_with_a_real_file(tmp_path, monkeypatch):
    """os.access says yes to root; what matters is whether a create succeeds (here: a
    read-only mount, simulated, since root cannot be denied in a plain folder)."""
    real_open = os.open

    def read_only_fs(path, flags, *args):
        if str(path).startswith(str(tmp_path)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(atomic_write.os, "open", read_only_fs)
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


# ------------------------------------------------------- the manifest's schema (defect 5)
def _small_snapshot(tmp_path, model_folder):
    path = tmp_path / "s.qspec"
    save_small(path, model_folder)
    return path


REQUIRED_KEYS = (
    sorted(snap.schema.REQUIRED)
    + [f"quantization.{k}" for k in snap.schema.QUANTIZATION]
    + [f"cache.{k}" for k in snap.schema.CACHE]
    + ["tensor_sha256.fp_k"]
)


def _delete(key):
    def edit(manifest):
        *parents, last = key.split(".")
        obj = manifest
        for parent in parents:
            obj = obj[parent]
        del obj[last]

    return edit


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_a_missing_manifest_key_is_corruption_even_with_a_valid_checksum(
    tmp_path, model_folder, key
):
    path = _small_snapshot(tmp_path, model_folder)
    _rewrite_manifest(path, _delete(key), fix_checksum=key != "manifest_sha256")
    # tensor_sha256 names its tensors: one fewer is "invalid", not "missing"
    expected = "invalid tensor_sha256" if key.startswith("tensor_sha256.") else f"missing {key}"
    if key == "manifest_sha256":
        expected = "manifest was modified"
    for read in (snap.read_manifest, snap.verify_snapshot, lambda p: load_small(p, model_folder)):
        with pytest.raises(QspecError, match=expected):
            read(path)


@pytest.mark.parametrize(
    "key, value",
    [
        ("tokens", "37"),
        ("tokens", 38),  # != n_quant + fp_len
        ("n_quant", -8),
        ("n_quant", 20),  # not whole groups
        ("fp_len", True),
        ("fp_len", 40),  # more than the cache's full-precision region
        ("model", None),
        ("created", 5),
        ("document_sha256", "ab"),
        ("document_bytes", -1),
        ("quantization", []),
        ("quantization.group_size", 0),
        ("quantization.group_size", 3),  # does not divide head_dim
        ("quantization.upper_bits", 8),
        ("quantization.fp_dtype", "float64"),
        ("quantization.fp_dtype", ["float32"]),
        ("cache.head_dim", 16.0),
        ("tensor_sha256.fp_k", "F" * 64),
        ("format", "other"),
        ("format_version", "1"),
    ],
)
def test_an_invalid_manifest_value_is_named(tmp_path, model_folder, key, value):
    path = _small_snapshot(tmp_path, model_folder)

    def edit(manifest):
        *parents, last = key.split(".")
        obj = manifest
        for parent in parents:
            obj = obj[parent]
        obj[last] = value

    _rewrite_manifest(path, edit, fix_checksum=True)
    with pytest.raises(QspecError, match=rf"corrupt manifest \(invalid {key.split('.')[0]}"):
        snap.read_manifest(path)


# ------------------------------------------------------- crafted headers (defect 6)
def _rewrite_header(path, edit):
    """Edit the safetensors header's tensor entries (offsets re-packed) and grow the file
    to match, sparsely: what safetensors itself would accept as a valid file."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    edit(header)
    offset = 0
    names = [k for k in header if k != "__metadata__"]
    for name in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
        size = snap.schema.nbytes(header[name]["dtype"], header[name]["shape"])
        header[name]["data_offsets"] = [offset, offset + size]
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    body = data[8 + n :][:offset]
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    os.truncate(path, 8 + len(raw) + offset)  # a hole, not 2 GiB of disk
    return 8 + len(raw)


def test_a_resized_tensor_is_refused_before_any_tensor_byte_is_read(
    tmp_path, model_folder, monkeypatch
):
    path = _small_snapshot(tmp_path, model_folder)
    header_end = _rewrite_header(
        path,
        lambda h: h["document_utf8"].update(shape=[2 * 2**30]),  # the tester's 2 GiB
    )
    assert path.stat().st_size > 2 * 2**30 and path.stat().st_blocks * 512 < 2**20
    read = []
    real_read = snap._read_exact
    monkeypatch.setattr(
        snap,
        "_read_exact",
        lambda f, p, offset, out: (read.append(len(out)), real_read(f, p, offset, out)),
    )
    for check in (snap.read_manifest, snap.verify_snapshot, lambda p: load_small(p, model_folder)):
        with pytest.raises(QspecError, match="tensor document_utf8 is U8"):
            check(path)
    assert sum(read) == 3 * header_end  # the header, three times; not one byte of data


# ------------------------------------------------------- verify without a model (defect 7)
def test_verify_snapshot_finds_a_flipped_bit_without_a_model(tmp_path, model_folder):
    path = _small_snapshot(tmp_path, model_folder)
    assert snap.verify_snapshot(path)["tokens"] == SMALL_TOKENS
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    assert snap.read_manifest(path)["tokens"] == SMALL_TOKENS  # the header is intact...
    with pytest.raises(QspecError, match="checksum mismatch in tensor"):
        snap.verify_snapshot(path)  # ...the data is not
    with pytest.raises(QspecError, match="checksum mismatch in tensor"):
        load_small(path, model_folder)


def test_small_snapshot_round_trip_and_safetensors_compatibility(tmp_path, model_folder):
    from safetensors import safe_open

    path = _small_snapshot(tmp_path, model_folder)
    state = small_cache().state()
    with safe_open(path, framework="pt") as f:  # still a plain, memory-mappable safetensors
        assert all(torch.equal(f.get_tensor(name), t) for name, t in state.items())
    loaded = load_small(path, model_folder)
    assert loaded.document == DOC and loaded.token_ids == list(range(SMALL_TOKENS))
    assert all(torch.equal(loaded.cache.state()[name], t) for name, t in state.items())
    with pytest.raises(QspecError, match="exceed the context"):
        snap.load_snapshot(path, model_folder, StubModel(), SMALL_TOKENS - 1, SMALL_G)


def _spy_reads(monkeypatch) -> list[int]:
    """Sizes of every read from a snapshot file (each tensor is allocated at its read size)."""
    reads, real = [], snap._read_exact

    def spy(f, path, offset, out):
        reads.append(len(out))
        return real(f, path, offset, out)

    monkeypatch.setattr(snap, "_read_exact", spy)
    return reads


def test_a_forged_document_size_is_hashed_before_it_is_allocated(
    tmp_path, model_folder, monkeypatch
):
    """Manifest edited (document_bytes, checksum recomputed) and header resized to match:
    structurally valid, so load must hash before it allocates what the file claims."""
    path = _small_snapshot(tmp_path, model_folder)
    forged = 256 * 2**20
    _rewrite_manifest(path, lambda m: m.update(document_bytes=forged), fix_checksum=True)
    _rewrite_header(path, lambda h: h["document_utf8"].update(shape=[forged]))
    snap.read_manifest(path)  # consistent as far as the header goes
    reads = _spy_reads(monkeypatch)
    with pytest.raises(QspecError, match="checksum mismatch in tensor document_utf8"):
        load_small(path, model_folder)
    assert max(reads) <= snap._CHUNK  # streamed, never read whole


def test_a_cache_shaped_for_another_model_is_refused_before_reading(
    tmp_path, model_folder, monkeypatch
):
    path = _small_snapshot(tmp_path, model_folder)
    _rewrite_manifest(path, lambda m: m["cache"].update(kv_heads=1), fix_checksum=True)

    def one_kv_head(header):
        for name in snap.schema.TENSORS:
            if name not in ("token_ids", "document_utf8"):  # the [L, B, n_kv, ...] ones
                header[name]["shape"][2] = 1

    _rewrite_header(path, one_kv_head)
    snap.read_manifest(path)  # a consistent file, for a model with one KV head
    reads = _spy_reads(monkeypatch)
    with pytest.raises(QspecError, match="does not fit this model's cache"):
        load_small(path, model_folder)
    assert len(reads) == 2  # the length and the header; no tensor


def test_manifests_without_document_bytes_are_bounded_per_token(tmp_path, model_folder):
    """The first snapshots had no document_bytes: their document may be at most
    DOC_BYTES_PER_TOKEN per token plus DOC_BYTES_SLACK."""
    path = _small_snapshot(tmp_path, model_folder)
    _rewrite_manifest(path, lambda m: m.pop("document_bytes"), fix_checksum=True)
    assert load_small(path, model_folder).document == DOC
    limit = snap.schema.DOC_BYTES_PER_TOKEN * SMALL_TOKENS + snap.schema.DOC_BYTES_SLACK
    _rewrite_header(path, lambda h: h["document_utf8"].update(shape=[limit + 1]))
    with pytest.raises(QspecError, match="tensor document_utf8 is U8"):
        snap.read_manifest(path)
