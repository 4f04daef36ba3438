"""Hierarchical KV snapshots on disk: prefill a document once, chat from it many times.

One safetensors file (memory-mappable): the cache's valid buffers (packed planes, scales and
zeros, full-precision region), the prefix token ids and the document's UTF-8 bytes; the JSON
manifest sits in the safetensors metadata. The manifest names the format version, the qspec
version, fingerprints of the model (config + target weights) and tokenizer (files + chat
template), the quantization parameters, the document hash and size, lengths, creation time,
a sha256 per tensor and one over the manifest itself (schema: store/schema.py).

Writing streams the file ourselves (no second copy in memory, no temporary file of the
library's) into one temporary sibling that atomic_write.py publishes: an interrupted or
killed prefill leaves nothing that looks like a snapshot, and two writers racing for one
output without --force cannot both win.

Reading trusts nothing: the file must be a regular file; the header is bounded and parsed
strictly; the manifest is checked against its schema; every tensor's dtype, shape and byte
range must be exactly what the manifest implies and tile the rest of the file, all before a
single tensor byte is read. Only then are tensors read (never more bytes than the file has)
and hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

import qspec_core
from qspec_core.atomic_write import check_output as check_output
from qspec_core.atomic_write import check_target, write_atomic
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.errors import QspecError
from qspec_core.model.checkpoint import checkpoint_files
from qspec_core.paths import sha256_file
from qspec_core.store import schema
from qspec_core.store.schema import FORMAT, FORMAT_VERSION, FORMAT_VERSIONS
from qspec_core.store.schema import estimate_bytes as estimate_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_HEADER = 1 << 20  # bytes of safetensors JSON header we parse; ours are a few KiB
_CHUNK = 1 << 20  # streaming read size of verify_snapshot
_CODES = {torch.uint8: "U8", torch.int64: "I64", torch.float32: "F32"}
_CODES |= {torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


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


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as they go to disk, without a copy (on CPU)."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(_raw(t)).hexdigest()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _manifest_sha(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass
class Snapshot:
    manifest: dict
    cache: HierarchicalKVCache
    token_ids: list[int]
    document: str


# ---------------------------------------------------------------------------------- writing
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
    """Write the snapshot atomically (see atomic_write.py); returns its manifest.

    QspecError, with no file left behind, when the output exists (without `force`), is not a
    regular file, cannot be written (permissions, disk full), or the cache is not exactly
    the committed tokens.
    """
    path = Path(path)
    check_target(path, force)  # before hashing the model's weights: fail fast
    meta = cache.meta()
    if meta["n_quant"] + meta["fp_len"] != len(token_ids) or cache.committed != len(token_ids):
        raise QspecError("the cache does not hold exactly the snapshot's committed tokens")
    # on the CPU once: hashing and writing then read the same host copies
    tensors = {name: t.cpu() for name, t in cache.state().items()}
    tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64).reshape(-1)
    tensors["document_utf8"] = _bytes_tensor(document.encode())
    manifest = _manifest(cache, meta, tensors, model_folder, model_name, extra)
    prefix = _header(tensors, manifest)
    _check_own_header(prefix, manifest, sum(t.numel() * t.element_size() for t in tensors.values()))

    def write(f: BinaryIO) -> None:
        _write_file(f, prefix, tensors)

    write_atomic(path, write, force)
    return manifest


def _manifest(cache, meta, tensors, model_folder, model_name, extra) -> dict:
    shas = {name: _tensor_sha(t) for name, t in tensors.items()}
    manifest = {
        "format": FORMAT,
        # (a model without sliding windows writes what every reader since version 1 reads)
        "format_version": FORMAT_VERSION if "local_base" in meta else 1,
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
        "cache": cache_config(cache),
        "document_sha256": shas["document_utf8"],  # (the tensor holds the UTF-8 bytes)
        "document_bytes": tensors["document_utf8"].numel(),
        "tokens": len(tensors["token_ids"]),
        "n_quant": meta["n_quant"],
        "fp_len": meta["fp_len"],
        "tensor_sha256": shas,
        # LongRoPE's factors were chosen by it (model/rope.py): a chat from the snapshot
        # rotates its new tokens alike, whatever its own capacity
        "rope_capacity": cache.rope_capacity,
        **({"local_base": meta["local_base"]} if "local_base" in meta else {}),
        **(extra or {}),
    }
    manifest["manifest_sha256"] = _manifest_sha(manifest)
    return manifest


def _header(tensors: dict[str, torch.Tensor], manifest: dict) -> bytes:
    """The safetensors prefix: 8-byte little-endian length, then the JSON header padded with
    spaces to a multiple of 8 (so the data that follows is aligned, as the format wants)."""
    header: dict = {"__metadata__": {"format": FORMAT, "manifest": json.dumps(manifest)}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _check_own_header(prefix: bytes, manifest: dict, data_bytes: int) -> None:
    """Run the reader's checks on what we are about to write: never write an unreadable file
    (e.g. an `extra` key that overrides a manifest field)."""
    try:
        schema.validate_manifest(manifest)
        header = json.loads(prefix[8:])
        del header["__metadata__"]
        schema.header_spans(header, manifest, data_bytes)
    except schema.SchemaError as e:
        raise QspecError(f"refusing to write a snapshot this qspec could not read ({e})") from None
    if len(prefix) - 8 > MAX_HEADER:
        raise QspecError("refusing to write a snapshot: its manifest is too large")


def _write_file(f: BinaryIO, prefix: bytes, tensors: dict[str, torch.Tensor]) -> None:
    f.write(prefix)
    for t in tensors.values():
        f.write(_raw(t))


def cache_config(cache: HierarchicalKVCache) -> dict:
    L, B, n_kv, _, D = cache.fp_k.shape
    out = {"layers": L, "batch": B, "kv_heads": n_kv, "head_dim": D}
    local = [layer for layer, w in enumerate(cache.windows) if w is not None]
    return out | ({"local_layers": local} if local else {})


# ---------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Span:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def _corrupt(path: Path, why: str) -> QspecError:
    return QspecError(f"{path}: not a readable snapshot (truncated or corrupt: {why})")


def _open(path: Path) -> BinaryIO:
    """The file, opened for reading only if it is a regular file (O_NONBLOCK: a FIFO put in
    its place must not hang us)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise QspecError(f"{path}: no such snapshot file") from None
    except OSError as e:
        raise QspecError(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise QspecError(f"{path}: not a snapshot file (a folder, device or FIFO)")
    return os.fdopen(fd, "rb", buffering=0)


def _read_exact(f: BinaryIO, path: Path, offset: int, out: memoryview) -> None:
    """Fill `out` from `offset`; the file shrinking underneath us is corruption too."""
    f.seek(offset)
    done = 0
    try:
        while done < len(out):
            got = f.readinto(out[done:])
            if not got:
                raise _corrupt(path, "the file ended early")
            done += got
    except OSError as e:
        raise QspecError(f"{path}: cannot read ({e.strerror})") from None


def _json_object(text: bytes | str, what: str, path: Path) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key")
        return dict(pairs)

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    try:
        if isinstance(text, bytes):
            text = text.decode()  # UTF-8 only (json.loads would also guess UTF-16 and 32)
        value = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting or numbers
        value = None
    if not isinstance(value, dict):
        raise _corrupt(path, f"{what} is not a JSON object")
    return value


def _inspect(f: BinaryIO, path: Path) -> tuple[dict, dict[str, _Span]]:
    """Manifest and tensor spans of an open snapshot, every check done, no tensor read."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _corrupt(path, f"{size} bytes")
    head = bytearray(8)
    _read_exact(f, path, 0, memoryview(head))
    n = struct.unpack("<Q", head)[0]
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        raise _corrupt(path, f"header length {n} in a file of {size} bytes")
    raw = bytearray(n)
    _read_exact(f, path, 8, memoryview(raw))
    header = _json_object(bytes(raw), "the header", path)
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise QspecError(f"{path}: not a qspec snapshot")
    if not isinstance(meta.get("manifest"), str):
        raise QspecError(f"{path}: corrupt manifest")
    manifest = _checked_manifest(meta["manifest"], path)
    try:
        spans = schema.header_spans(header, manifest, size - 8 - n)
    except schema.SchemaError as e:
        raise _corrupt(path, str(e)) from None
    return manifest, {
        name: _Span(d, s, 8 + n + b, 8 + n + e) for name, (d, s, b, e) in spans.items()
    }


def _checked_manifest(text: str, path: Path) -> dict:
    try:
        manifest = _json_object(text, "the manifest", path)
    except QspecError:
        raise QspecError(f"{path}: corrupt manifest") from None
    try:
        intact = manifest.get("manifest_sha256") == _manifest_sha(manifest)
    except RecursionError:  # nesting that json.loads took but json.dumps does not
        raise QspecError(f"{path}: corrupt manifest") from None
    if not intact:
        raise QspecError(f"{path}: the manifest was modified after writing (checksum mismatch)")
    version = manifest.get("format_version")
    if isinstance(version, int) and version not in FORMAT_VERSIONS:
        raise QspecError(
            f"{path}: snapshot format version {version}, "
            f"this qspec reads version {FORMAT_VERSION}; prefill the document again"
        )
    try:
        schema.validate_manifest(manifest)
    except schema.SchemaError as e:
        raise QspecError(f"{path}: corrupt manifest ({e})") from None
    return manifest


def read_manifest(path: Path) -> dict:
    """The manifest of a snapshot file, checked for format, schema and tensor layout (cheap:
    no tensor data is read; verify_snapshot checks the data too)."""
    path = Path(path)
    with _open(path) as f:
        return _inspect(f, path)[0]


def verify_snapshot(path: Path) -> dict:
    """read_manifest plus every tensor's sha256, streamed (memory bounded by one chunk);
    no model needed. QspecError on any corruption; returns the manifest."""
    path = Path(path)
    with _open(path) as f:
        manifest, spans = _inspect(f, path)
        for name, span in spans.items():
            _check_sha(_stream_sha(f, path, span), manifest, name, path)
    return manifest


def _stream_sha(f: BinaryIO, path: Path, span: _Span) -> str:
    size = span.end - span.begin
    digest, buffer = hashlib.sha256(), memoryview(bytearray(min(_CHUNK, size)))
    for offset in range(span.begin, span.end, _CHUNK):
        chunk = buffer[: min(_CHUNK, span.end - offset)]
        _read_exact(f, path, offset, chunk)
        digest.update(chunk)
    return digest.hexdigest()


def _check_sha(digest: str, manifest: dict, name: str, path: Path) -> None:
    if digest != manifest["tensor_sha256"][name]:
        raise QspecError(f"{path}: corrupt snapshot (checksum mismatch in tensor {name})")


def _read_tensor(f: BinaryIO, path: Path, span: _Span) -> torch.Tensor:
    """One tensor, read into a buffer of exactly its (already checked) size."""
    data = torch.empty(span.end - span.begin, dtype=torch.uint8)
    _read_exact(f, path, span.begin, memoryview(data.numpy()))
    return data.view(_DTYPES[span.dtype]).reshape(span.shape)


def check_compatible(
    manifest: dict,
    model_folder: Path,
    group_size: int | None,
    model,
    target_weights: str = "full",
) -> None:
    """Raise naming the first mismatch between a snapshot and the model/settings at hand
    (`target_weights`: the weights this run's target path uses, `Runtime.target_weights`)."""
    if manifest["model_fingerprint"] != model_fingerprint(model_folder):
        raise QspecError(
            f"snapshot was made with another model ({manifest['model']}, weights "
            f"or config differ from {model_folder})"
        )
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(model_folder):
        raise QspecError("snapshot was made with another tokenizer or chat template")
    made, now = manifest.get("target_weights", "full"), target_weights
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
    path: Path,
    model_folder: Path,
    model,
    capacity: int,
    group_size: int | None = None,
    target_weights: str = "full",
) -> Snapshot:
    """Load and verify a snapshot into a fresh hierarchical cache that holds its tokens (a
    session grows it for what comes next); `capacity`: the context it may not exceed.

    Allocates no more than this model's cache of its tokens and the document take:
    the cache's shape is checked against the model before any read, and the document (the
    one tensor the cache does not bound) is hashed in chunks before it is read into memory.
    """
    path = Path(path)
    with _open(path) as f:
        manifest, spans = _inspect(f, path)
        check_compatible(manifest, model_folder, group_size, model, target_weights)
        _check_fits(manifest, model, capacity, path)
        document_span = spans["document_utf8"]
        _check_sha(_stream_sha(f, path, document_span), manifest, "document_utf8", path)
        tensors = {}
        for name, span in spans.items():
            tensors[name] = _read_tensor(f, path, span)
            if name != "document_utf8":  # (hashed above, before it was read into memory)
                _check_sha(_tensor_sha(tensors[name]), manifest, name, path)
    token_ids = tensors.pop("token_ids").tolist()
    try:
        document = str(memoryview(tensors.pop("document_utf8").numpy()), "utf-8")
    except UnicodeDecodeError:
        raise QspecError(f"{path}: corrupt snapshot (the document is not UTF-8)") from None
    return Snapshot(
        manifest, _cache_from(tensors, manifest, model, capacity, path), token_ids, document
    )


def _check_fits(manifest: dict, model, capacity: int, path: Path) -> None:
    c = model.config
    dims = (c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim)  # batch 1, as built
    made = tuple(manifest["cache"][k] for k in ("layers", "batch", "kv_heads", "head_dim"))
    if made != dims:  # the fingerprints matched: only a forged manifest gets here
        raise QspecError(f"{path}: snapshot does not fit this model's cache ({manifest['cache']})")
    if manifest["tokens"] > capacity:
        raise QspecError(f"{path}: {manifest['tokens']} tokens exceed the context ({capacity})")


def _cache_from(tensors: dict, manifest: dict, model, capacity: int, path: Path):
    G = manifest["quantization"]["group_size"]
    for name in ("fp_k", "fp_v"):
        tensors[name] = tensors[name].to(model.dtype)  # no copy when the dtypes agree
    meta = {"group_size": G, "n_quant": manifest["n_quant"], "fp_len": manifest["fp_len"]}
    local = [layer for layer, w in enumerate(model.config.windows) if w is not None]
    if manifest["cache"].get("local_layers", local) != local:  # (version 1: every layer)
        raise QspecError(f"{path}: snapshot's sliding-window layers are not this model's")
    meta["local_base"] = manifest.get("local_base", 0)
    try:  # the fingerprint matched, so only a forged manifest's shapes can fail here
        cache = HierarchicalKVCache(
            model.config,
            manifest["tokens"],
            G,
            dtype=model.dtype,
            device=model.device,
            # (older snapshots have none: they were made at the whole context)
            rope_capacity=manifest.get("rope_capacity") or capacity,
        )
        cache.load_state(tensors, meta | {"committed": manifest["tokens"]})
    except (RuntimeError, ValueError) as e:
        raise QspecError(f"{path}: snapshot does not fit this model's cache ({e})") from None
    return cache
