"""Snapshots: round trip, mismatch detection, corruption, atomic writes, fresh-process load."""

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from conftest import DATA

from qspec_core import snapshot as snap
from qspec_core.errors import QspecError
from qspec_core.runtime import load_runtime
from qspec_core.session import ChatSession

DOC = "The lighthouse keeper counted 41 ships in March and 17 in April. " * 6


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

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr(snap, "save_file", failing_save)
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
