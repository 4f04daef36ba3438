"""Hierarchical KV snapshots on disk: prefill a document once, chat from it many times.

One safetensors file (memory-mappable): the cache's valid buffers (packed planes, scales and
zeros, full-precision region), the prefix token ids and the document's UTF-8 bytes; the JSON
manifest sits in the safetensors metadata. The manifest names the format version, the qspec
version, fingerprints of the model (config + target weights) and tokenizer (files + chat
template), the quantization parameters, the document hash, lengths, creation time, a sha256
per tensor and one over the manifest itself. Writes go to a temporary sibling that is renamed
into place: an interrupted prefill leaves nothing that looks like a snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import qspec_core
from qspec_core.errors import QspecError
from qspec_core.hier_cache import HierarchicalKVCache
from qspec_core.models import sha256_file
from qspec_core.weights import checkpoint_files

FORMAT = "qspec-kv-snapshot"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_fingerprint(folder: Path) -> str:
    """sha256 over config.json and the target weights (not the draft: the KV is the target's)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for f in checkpoint_files(folder):
        digest.update(f.name.encode() + sha256_file(f).encode())
    return digest.hexdigest()


def tokenizer_fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        digest.update(name.encode() + (path.read_bytes() if path.exists() else b"-"))
    return digest.hexdigest()


def _tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _manifest_sha(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass
class Snapshot:
    manifest: dict
    cache: HierarchicalKVCache
    token_ids: list[int]
    document: str


def save_snapshot(
    path: Path,
    cache: HierarchicalKVCache,
    token_ids: list[int],
    document: str,
    model_folder: Path,
    model_name: str,
    force: bool = False,
    extra: dict | None = None,
) -> dict:
    """Write the snapshot atomically; returns its manifest."""
    path = Path(path)
    if path.exists() and not force:
        raise QspecError(f"{path} exists; pass --force to overwrite it")
    if path.is_dir():
        raise QspecError(f"{path} is a folder")
    meta = cache.meta()
    if meta["n_quant"] + meta["fp_len"] != len(token_ids) or cache.committed != len(token_ids):
        raise QspecError("the cache does not hold exactly the snapshot's committed tokens")
    tensors = dict(cache.state())
    tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
    tensors["document_utf8"] = torch.frombuffer(bytearray(document.encode()), dtype=torch.uint8)
    config = cache_config(cache)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "qspec_version": qspec_core.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_name,
        "model_fingerprint": model_fingerprint(model_folder),
        "tokenizer_fingerprint": tokenizer_fingerprint(model_folder),
        "quantization": {
            "group_size": meta["group_size"],
            "upper_bits": 4,
            "lower_bits": 4,
            "key_grouping": "per-channel",
            "value_grouping": "per-token",
            "metadata_dtype": "float32",
            "fp_dtype": meta["fp_dtype"],
        },
        "cache": config,
        "document_sha256": hashlib.sha256(document.encode()).hexdigest(),
        "tokens": len(token_ids),
        "n_quant": meta["n_quant"],
        "fp_len": meta["fp_len"],
        "tensor_sha256": {name: _tensor_sha(t) for name, t in tensors.items()},
        **(extra or {}),
    }
    manifest["manifest_sha256"] = _manifest_sha(manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": FORMAT, "manifest": json.dumps(manifest)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return manifest


def cache_config(cache: HierarchicalKVCache) -> dict:
    L, B, n_kv = cache.k_upper.shape[:3]
    return {"layers": L, "batch": B, "kv_heads": n_kv, "head_dim": 2 * cache.k_upper.shape[4]}


def read_manifest(path: Path) -> dict:
    """The manifest of a snapshot file, checked for format and self-consistency."""
    path = Path(path)
    if not path.is_file():
        raise QspecError(f"{path}: no such snapshot file")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise QspecError(f"{path}: not a readable snapshot (truncated or corrupt: {e})") from None
    if meta.get("format") != FORMAT or "manifest" not in meta:
        raise QspecError(f"{path}: not a qspec snapshot")
    try:
        manifest = json.loads(meta["manifest"])
    except json.JSONDecodeError:
        raise QspecError(f"{path}: corrupt manifest") from None
    if manifest.get("manifest_sha256") != _manifest_sha(manifest):
        raise QspecError(f"{path}: the manifest was modified after writing (checksum mismatch)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise QspecError(
            f"{path}: snapshot format version {manifest.get('format_version')}, "
            f"this qspec reads version {FORMAT_VERSION}; prefill the document again"
        )
    return manifest


def check_compatible(manifest: dict, model_folder: Path, group_size: int | None, model) -> None:
    """Raise naming the first mismatch between a snapshot and the model/settings at hand."""
    if manifest["model_fingerprint"] != model_fingerprint(model_folder):
        raise QspecError(
            f"snapshot was made with another model ({manifest['model']}, weights "
            f"or config differ from {model_folder})"
        )
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(model_folder):
        raise QspecError("snapshot was made with another tokenizer or chat template")
    from qspec_core.model import target_weights

    made, now = manifest.get("target_weights", "full"), target_weights(model)
    if made != now:  # the KV was computed by other weights
        raise QspecError(
            f"snapshot was made with --target-weights {made}, this run uses {now}; pass "
            f"--target-weights {made} or prefill again"
        )
    G = group_size or model.config.head_dim
    if manifest["quantization"]["group_size"] != G:
        raise QspecError(
            f"snapshot uses KV group size {manifest['quantization']['group_size']},"
            f" this run {G}; pass --group-size "
            f"{manifest['quantization']['group_size']} or prefill again"
        )


def load_snapshot(
    path: Path, model_folder: Path, model, capacity: int, group_size: int | None = None
) -> Snapshot:
    """Load and verify a snapshot into a fresh hierarchical cache of `capacity` positions."""
    manifest = read_manifest(path)
    check_compatible(manifest, model_folder, group_size, model)
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise QspecError(f"{path}: corrupt snapshot ({e})") from None
    expected = manifest["tensor_sha256"]
    if set(tensors) != set(expected):
        raise QspecError(f"{path}: corrupt snapshot (tensors differ from the manifest)")
    for name, t in tensors.items():
        if _tensor_sha(t) != expected[name]:
            raise QspecError(f"{path}: corrupt snapshot (checksum mismatch in tensor {name})")
    token_ids = tensors.pop("token_ids").tolist()
    document = bytes(tensors.pop("document_utf8").numpy()).decode()
    fp_dtype = getattr(torch, manifest["quantization"]["fp_dtype"])
    if manifest["tokens"] > capacity:
        raise QspecError(f"{path}: {manifest['tokens']} tokens exceed the context ({capacity})")
    cache = HierarchicalKVCache(
        model.config,
        capacity,
        manifest["quantization"]["group_size"],
        dtype=model.dtype,
        device=model.device,
    )
    if fp_dtype != model.dtype:
        tensors["fp_k"], tensors["fp_v"] = (
            tensors["fp_k"].to(model.dtype),
            tensors["fp_v"].to(model.dtype),
        )
    try:
        cache.load_state(
            tensors,
            {
                "group_size": manifest["quantization"]["group_size"],
                "n_quant": manifest["n_quant"],
                "fp_len": manifest["fp_len"],
                "committed": manifest["tokens"],
            },
        )
    except (RuntimeError, ValueError) as e:
        raise QspecError(f"{path}: snapshot does not fit this model's cache ({e})") from None
    return Snapshot(manifest, cache, token_ids, document)
