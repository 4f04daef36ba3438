"""Snapshot files: the manifest's schema, crafted safetensors headers, verification without a
model, and allocations bounded by what a file may claim. Small random caches (test_snapshot.py's
helpers), no runtime."""

import pytest
import torch
from test_snapshot import (
    DOC,
    SMALL_G,
    SMALL_TOKENS,
    StubModel,
    _rewrite_header,
    _rewrite_manifest,
    fake_model_folder,
    load_small,
    save_small,
    small_cache,
)

from qspec_core.errors import QspecError
from qspec_core.store import snapshot as snap


@pytest.fixture
def model_folder(tmp_path):
    return fake_model_folder(tmp_path / "model")


# ------------------------------------------------------- the manifest's schema (defect 5)
def _small_snapshot(tmp_path, model_folder):
    path = tmp_path / "s.qspec"
    save_small(path, model_folder)
    return path


def _spy_reads(monkeypatch) -> list[int]:
    """Sizes of every read from a snapshot file (each tensor is allocated at its read size)."""
    reads, real = [], snap._read_exact

    def spy(f, path, offset, out):
        reads.append(len(out))
        return real(f, path, offset, out)

    monkeypatch.setattr(snap, "_read_exact", spy)
    return reads


REQUIRED_KEYS = (
    sorted(snap.schema.REQUIRED)
    + [f"quantization.{k}" for k in snap.schema.QUANTIZATION]
    + [f"cache.{k}" for k in snap.schema.CACHE]
    + ["tensor_sha256.fp_k"]
)


def _parent(manifest: dict, key: str) -> tuple[dict, str]:
    """The object that holds a dotted key ("cache.head_dim"), and the key's last part."""
    *parents, last = key.split(".")
    for parent in parents:
        manifest = manifest[parent]
    return manifest, last


def _delete(key):
    def edit(manifest):
        obj, last = _parent(manifest, key)
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
        obj, last = _parent(manifest, key)
        obj[last] = value

    _rewrite_manifest(path, edit, fix_checksum=True)
    with pytest.raises(QspecError, match=rf"corrupt manifest \(invalid {key.split('.')[0]}"):
        snap.read_manifest(path)


# ------------------------------------------------------- crafted headers (defect 6)


def test_a_resized_tensor_is_refused_before_any_tensor_byte_is_read(
    tmp_path, model_folder, monkeypatch
):
    path = _small_snapshot(tmp_path, model_folder)
    header_end = _rewrite_header(
        path,
        lambda h: h["document_utf8"].update(shape=[2 * 2**30]),  # the tester's 2 GiB
    )
    assert path.stat().st_size > 2 * 2**30 and path.stat().st_blocks * 512 < 2**20
    reads = _spy_reads(monkeypatch)
    for check in (snap.read_manifest, snap.verify_snapshot, lambda p: load_small(p, model_folder)):
        with pytest.raises(QspecError, match="tensor document_utf8 is U8"):
            check(path)
    assert sum(reads) == 3 * header_end  # the header, three times; not one byte of data


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
