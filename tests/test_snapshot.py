"""Snapshots on a model: round trip, mismatch detection, corruption, interrupted writes,
fresh-process load; and the helpers the other snapshot tests share.

Most robustness tests use a small cache filled with random KV (`small_cache`) and a fake model
folder: no runtime, milliseconds per snapshot. They live in test_snapshot_output.py (what may
be written where), test_snapshot_manifest.py (damaged and crafted files) and
test_snapshot_fuzz.py, and import their helpers from here.
"""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import DATA, run_qspec

from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.config import ModelConfig
from qspec_core.engine.session import ChatSession
from qspec_core.errors import QspecError
from qspec_core.registry.runtime import load_runtime
from qspec_core.store import snapshot as snap

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


@pytest.fixture(scope="module")
def windowed(tiny_model_dir, tmp_path_factory):
    """The tiny model as a Mistral with a 16-token sliding window on every layer: DOC (about
    100 tokens) is several windows long."""
    import transformers

    from qspec_core.convert.convert import convert
    from qspec_core.model.checkpoint import load_model

    hf = tmp_path_factory.mktemp("windowed-hf")
    llama = json.loads((tiny_model_dir / "config.json").read_text())
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "max_position_embeddings")  # fmt: skip
    config = transformers.MistralConfig(
        **{k: llama[k] for k in fields}, sliding_window=16, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, hf / name)
    out = tmp_path_factory.mktemp("windowed") / "mistral"
    convert(hf, out, load_model(hf, dtype=torch.float32), "rtn", 32)
    return load_runtime(str(out), dtype="fp32", log=lambda m: None)


@pytest.mark.parametrize("mode", ["quantspec", "target-ar"])
def test_a_windowed_model_chats_from_its_snapshot_as_from_its_document(windowed, tmp_path, mode):
    """A sliding-window model's snapshot holds each layer's window of planes (format 2), and
    its region: the chat from it answers as the chat that prefilled the document, past the
    window."""
    assert windowed.model.config.windows == (16, 16)
    path = tmp_path / "doc.qspec"
    _make(windowed, path)
    manifest = snap.read_manifest(path)
    assert manifest["format_version"] == 2 and manifest["cache"]["local_layers"] == [0, 1]
    held = manifest["n_quant"] - manifest["local_base"]  # (G = 16: the window's group, +1)
    assert manifest["n_quant"] > 3 * 16 and held <= 2 * 16
    loaded = snap.load_snapshot(path, windowed.folder, windowed.model, windowed.context_limit)
    assert len(loaded.token_ids) > 4 * 16
    from_snapshot = ChatSession(windowed, loaded.document, mode=mode, max_new_tokens=16)
    from_snapshot.adopt_cache(loaded.cache, loaded.token_ids)
    direct = ChatSession(windowed, DOC, mode=mode, max_new_tokens=16)
    for question in ("How many ships?", "And in April?"):
        assert _answer(from_snapshot, question) == _answer(direct, question)


def test_a_snapshot_keeps_the_capacity_its_rope_was_chosen_by(tiny, tmp_path):
    """LongRoPE (Phi-3.5) picks its factors by the cache's rope_capacity: a chat loading the
    snapshot into a cache of another size (its tokens, grown as a chat goes) must rotate its
    new tokens as the prefill did."""
    path = tmp_path / "doc.qspec"
    _make(tiny, path)
    manifest = snap.read_manifest(path)
    made = manifest["rope_capacity"]
    loaded = snap.load_snapshot(path, tiny.folder, tiny.model, made + 64)
    assert loaded.cache.max_seq_len == manifest["tokens"] and loaded.cache.rope_capacity == made
    loaded.cache.grow(made + 64)
    assert loaded.cache.max_seq_len == made + 64 and loaded.cache.rope_capacity == made


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


def _read_header(path) -> tuple[bytes, int, dict]:
    """(the file's bytes, the header's length, the safetensors header)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return data, n, json.loads(data[8 : 8 + n])


def _packed_header(header: dict) -> bytes:
    """The length prefix and the header, padded to 8 bytes as safetensors writes it."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _rewrite_manifest(path, edit, fix_checksum):
    """Edit the JSON manifest inside the safetensors header, keeping the file valid."""
    data, n, header = _read_header(path)
    manifest = json.loads(header["__metadata__"]["manifest"])
    edit(manifest)
    if fix_checksum:
        manifest["manifest_sha256"] = snap._manifest_sha(manifest)
    header["__metadata__"]["manifest"] = json.dumps(manifest)
    path.write_bytes(_packed_header(header) + data[8 + n :])


def _rewrite_header(path, edit):
    """Edit the safetensors header's tensor entries (offsets re-packed) and grow the file
    to match, sparsely: what safetensors itself would accept as a valid file."""
    data, n, header = _read_header(path)
    edit(header)
    offset = 0
    names = [k for k in header if k != "__metadata__"]
    for name in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
        size = snap.schema.nbytes(header[name]["dtype"], header[name]["shape"])
        header[name]["data_offsets"] = [offset, offset + size]
        offset += size
    packed = _packed_header(header)
    path.write_bytes(packed + data[8 + n :][:offset])
    os.truncate(path, len(packed) + offset)  # a hole, not 2 GiB of disk
    return len(packed)


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
    model, snapshot = ["--model", tiny_model_dir], tmp_path / "doc.qspec"
    proc = run_qspec("prefill", doc, *model, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["output"].endswith("doc.qspec") and result["bytes"] > 0
    doc.unlink()  # the snapshot must not need the document
    question = "How many ships?\n/exit\n"
    chat = run_qspec("chat", snapshot, *model, "--max-new-tokens", 4, input=question, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert "tokens per target" in chat.stdout
    info = run_qspec("info", snapshot, *model, "--json", timeout=300)
    assert json.loads(info.stdout)["matches"] == {"model": True, "tokenizer": True}
    # the CPU default target (auto) resolved and recorded, never "auto" itself
    assert json.loads(info.stdout)["target_weights"] == result["target_weights"] == "w8a8"
    again = run_qspec("prefill", snapshot, timeout=300)
    assert again.returncode == 2 and "error:" in again.stderr


def test_truncated_snapshot_leaves_room_for_the_answer(tiny_model_dir, tmp_path):
    """`prefill --truncate` of a document longer than the context: the snapshot keeps room
    for a question and an answer (half the tiny model's 512 tokens), and summarize uses it
    as is, with or without --truncate (which must not cut the snapshot's document again)."""
    from qspec_cli.app import main

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
def test_real_model_snapshot_round_trip(tmp_path, default_converted):
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
