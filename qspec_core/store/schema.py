"""The snapshot manifest's schema and the tensor layout it implies (pure functions, no I/O).

A reader trusts nothing in a snapshot before this module has checked it: every key that the
loader and `qspec info` use, with its type, and the exact dtype and shape of every tensor
(what `HierarchicalKVCache.state()` produces for the manifest's lengths). The safetensors
header must agree with that layout before a single tensor byte is read, so a crafted header
cannot make the reader allocate more than the manifest, and the file, account for.
"""

from __future__ import annotations

import math
import re

from qspec_core.cache.hier_planes import LOCAL, PLANE_BUFFERS

FORMAT = "qspec-kv-snapshot"
# 2: a model with sliding-window layers stores their planes apart, from `local_base` on
# (`LOCAL_PLANES`); 1: every layer's planes from position 0 (what a model without windows,
# and every snapshot before December 2026, has). A reader reads both.
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
FP_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # manifest -> header
ITEMSIZE = {"U8": 1, "I64": 8, "F32": 4, "F16": 2, "BF16": 2}
PLANES = ("k_upper", "k_lower", "v_upper", "v_lower")
TENSORS = (*PLANES, "v_scale", "v_zero", "k_scale", "k_zero", "fp_k", "fp_v")
TENSORS += ("token_ids", "document_utf8")
# the cache's local (sliding-window) stack, by the names `HierarchicalKVCache.state()` gives
LOCAL_PLANES = tuple(LOCAL + name for name in PLANE_BUFFERS)
# Manifests without `document_bytes` (the first files written): the document is at most this
# many UTF-8 bytes per token plus a constant. Tokens of byte-level BPE vocabularies are far
# shorter than 256 bytes; the constant covers the chat framing around the document.
DOC_BYTES_PER_TOKEN, DOC_BYTES_SLACK = 256, 4096
FP_SLOTS = 3  # the cache's full-precision region holds 3 groups (cache/hierarchical.py)


class SchemaError(ValueError):
    """A manifest key is missing or invalid; str() is "missing KEY" or "invalid KEY"."""


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive(v) -> bool:
    return _count(v) and v > 0


def _str(v) -> bool:
    return isinstance(v, str)


def _hex64(v) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _one_of(*values):
    return lambda v: isinstance(v, type(values[0])) and v in values


REQUIRED = {
    "format": _one_of(FORMAT),
    "format_version": _count,
    "qspec_version": _str,
    "created": _str,
    "model": _str,
    "model_fingerprint": _hex64,
    "tokenizer_fingerprint": _hex64,
    "quantization": dict,
    "cache": dict,
    "document_sha256": _hex64,
    "tokens": _count,
    "n_quant": _count,
    "fp_len": _count,
    "tensor_sha256": dict,
    "manifest_sha256": _hex64,
}
OPTIONAL = {
    "document_bytes": _count,
    "target_weights": _str,
    "prefill_seconds": _number,
    "compute_dtype": _str,
    "rope_capacity": _positive,  # (older snapshots have none)
    "local_base": _count,  # (version 2, sliding-window layers: where their planes begin)
}
QUANTIZATION = {
    "group_size": _positive,
    "upper_bits": _one_of(4),
    "lower_bits": _one_of(4),
    "key_grouping": _one_of("per-channel"),
    "value_grouping": _one_of("per-token"),
    "metadata_dtype": _one_of("float32"),
    "fp_dtype": _one_of(*FP_DTYPES),
}
CACHE = {"layers": _positive, "batch": _positive, "kv_heads": _positive, "head_dim": _positive}


def _layers(v) -> bool:
    """cache.local_layers: layer indices, increasing, at least one."""
    return isinstance(v, list) and len(v) > 0 and all(_count(i) for i in v) and v == sorted(set(v))


CACHE_OPTIONAL = {"local_layers": _layers}  # (version 2: the sliding-window layers)


def tensor_names(manifest: dict) -> tuple[str, ...]:
    """The tensors a manifest's snapshot holds."""
    return TENSORS + (LOCAL_PLANES if "local_layers" in manifest["cache"] else ())


def _check_fields(obj: dict, spec: dict, prefix: str = "", required: bool = True) -> None:
    for key, ok in spec.items():
        if key not in obj:
            if required:
                raise SchemaError(f"missing {prefix}{key}")
            continue
        valid = isinstance(obj[key], dict) if ok is dict else ok(obj[key])
        if not valid:
            raise SchemaError(f"invalid {prefix}{key}")


def _require(ok: bool, key: str) -> None:
    if not ok:
        raise SchemaError(f"invalid {key}")


def validate_manifest(manifest) -> None:
    """Raise SchemaError unless `manifest` has every key a reader uses, well typed and
    consistent (lengths add up, the group size divides head_dim, one sha256 per tensor)."""
    if not isinstance(manifest, dict):
        raise SchemaError("invalid manifest (not an object)")
    _check_fields(manifest, REQUIRED)
    _check_fields(manifest, OPTIONAL, required=False)
    q, c = manifest["quantization"], manifest["cache"]
    _check_fields(q, QUANTIZATION, "quantization.")
    _check_fields(c, CACHE, "cache.")
    _check_fields(c, CACHE_OPTIONAL, "cache.", required=False)
    G, D, nq = q["group_size"], c["head_dim"], manifest["n_quant"]
    _require(D % 2 == 0 and D % G == 0, "quantization.group_size")
    _require(nq % G == 0, "n_quant")
    windowed = "local_layers" in c
    _require(windowed == (manifest["format_version"] >= 2), "format_version")
    _require(windowed == ("local_base" in manifest), "local_base")
    if windowed:
        base = manifest["local_base"]
        _require(c["local_layers"][-1] < c["layers"], "cache.local_layers")
        _require(base % G == 0 and base <= nq, "local_base")
    _require(manifest["fp_len"] <= FP_SLOTS * G, "fp_len")
    _require(manifest["tokens"] == nq + manifest["fp_len"], "tokens")
    shas = manifest["tensor_sha256"]
    _require(set(shas) == set(tensor_names(manifest)), "tensor_sha256")
    for name in tensor_names(manifest):
        _require(_hex64(shas[name]), f"tensor_sha256.{name}")
    # the document's hash and its tensor's hash are one hash of the same bytes
    _require(shas["document_utf8"] == manifest["document_sha256"], "document_sha256")


def layout(manifest: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """dtype and shape of every tensor but `document_utf8`, as `cache.state()` makes them."""
    c, q = manifest["cache"], manifest["quantization"]
    L, lead = c["layers"], (c["batch"], c["kv_heads"])
    G, D, nq, n_fp = q["group_size"], c["head_dim"], manifest["n_quant"], manifest["fp_len"]
    fp = FP_DTYPES[q["fp_dtype"]]
    n_local = len(c.get("local_layers", ()))
    out = _planes("", (L - n_local, *lead), nq, G, D)  # (version 1: every layer)
    if n_local:
        out |= _planes(LOCAL, (n_local, *lead), nq - manifest["local_base"], G, D)
    out["fp_k"] = out["fp_v"] = (fp, (L, *lead, n_fp, D))
    out["token_ids"] = ("I64", (manifest["tokens"],))
    return out


def _planes(prefix: str, lead: tuple, n: int, G: int, D: int) -> dict:
    """dtype and shape of a stack's planes and scales, `lead` [layers, B, n_kv], n positions."""
    out = {prefix + name: ("U8", (*lead, n, D // 2)) for name in PLANES}  # two nibbles a byte
    out[prefix + "v_scale"] = out[prefix + "v_zero"] = ("F32", (*lead, n, D // G))  # per token
    out[prefix + "k_scale"] = out[prefix + "k_zero"] = ("F32", (*lead, n // G, D))  # per channel
    return out


def document_bytes_ok(manifest: dict, n: int) -> bool:
    """Whether a `document_utf8` of n bytes is what the manifest allows."""
    if "document_bytes" in manifest:
        return n == manifest["document_bytes"]
    return n <= DOC_BYTES_PER_TOKEN * manifest["tokens"] + DOC_BYTES_SLACK


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return ITEMSIZE[dtype] * math.prod(shape)


def _entry(info, name: str) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one safetensors header entry, strictly typed."""
    bad = SchemaError(f"bad header entry for {name!r}")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not (isinstance(dtype, str) and dtype in ITEMSIZE):
        raise bad
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise bad
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise bad
    return dtype, tuple(shape), offsets[0], offsets[1]


def header_spans(header: dict, manifest: dict, data_bytes: int) -> dict[str, tuple]:
    """name -> (dtype, shape, begin, end) of a validated manifest's tensors, offsets relative
    to the data section. SchemaError unless the header holds exactly the manifest's tensors,
    each with the dtype and shape the manifest implies, packed back to back over exactly
    `data_bytes` bytes: after this, reading a tensor allocates what the file holds."""
    want = layout(manifest)
    if set(header) != set(tensor_names(manifest)):
        raise SchemaError("tensors differ from the manifest")
    spans = {}
    for name, info in header.items():
        dtype, shape, begin, end = _entry(info, name)
        if name == "document_utf8":
            ok = dtype == "U8" and len(shape) == 1 and document_bytes_ok(manifest, shape[0])
        else:
            ok = (dtype, shape) == want[name]
        if not ok:
            raise SchemaError(f"tensor {name} is {dtype}{list(shape)}, not what the manifest says")
        if end < begin or end - begin != nbytes(dtype, shape):
            raise SchemaError(f"tensor {name}'s byte range does not match its shape")
        spans[name] = (dtype, shape, begin, end)
    end = 0
    for _, _, begin, stop in sorted(spans.values(), key=lambda s: s[2]):
        if begin != end:
            raise SchemaError("tensor byte ranges overlap or leave gaps")
        end = stop
    if end != data_bytes:
        raise SchemaError(f"the tensors take {end} bytes, the file holds {data_bytes}")
    return spans


def estimate_bytes(
    config, tokens: int, group_size: int | None, dtype, document_bytes: int = 0
) -> int:
    """About the size of the snapshot of a `tokens`-long prefix, to check free space before
    a prefill: `config` is the model's ModelConfig, `dtype` its compute torch dtype."""
    G = group_size or config.head_dim
    n_quant = max(0, (tokens // G - 1) * G)  # HierarchicalKVCache.load_full_precision's split
    manifest = {
        "cache": {"layers": config.num_hidden_layers, "batch": 1},
        "quantization": {"group_size": G, "fp_dtype": str(dtype).removeprefix("torch.")},
        "tokens": tokens,
        "n_quant": n_quant,
        "fp_len": tokens - n_quant,
    }
    manifest["cache"] |= {"kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}
    tensors = sum(nbytes(*spec) for spec in layout(manifest).values())
    return tensors + document_bytes + 64 * 1024  # + the header, generously
