"""4-bit GPTQ and AWQ checkpoints <-> one canonical in-memory form, `Int4Weight`.

The layouts follow the public producers (AutoGPTQ/GPTQModel, AutoAWQ); see the
"Checkpoint formats" section of the project facts. For an `nn.Linear` weight [N=out, K=in]:

- GPTQ: `qweight` int32 [K/8, N] packed along the input dim, nibble j of a word at bits 4*j;
  `qzeros` int32 [n_groups, N/8] packed along the output dim, same order; `scales` fp16
  [n_groups, N]; `g_idx` int32 [K]. "gptq" (v1) stores every zero point minus one,
  "gptq_v2" stores it as-is.
- AWQ GEMM: `qweight` int32 [K, N/8] packed along the output dim in the interleaved nibble
  order `AWQ_PACK_ORDER`; `qzeros` int32 [K/g, N/8] the same way; `scales` fp16 [K/g, N].

Both dequantize as `(q - zero) * scale`, which is what `Int4Weight.dequantize` computes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from qspec_core.errors import QspecError
from qspec_core.model.checkpoint import load_state_dict

# Nibble j of a packed int32 word sits at bits [4*j, 4*j + 4), lowest first (both formats).
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]

# AutoAWQ interleaves the 8 output columns of a word: bits 4*j hold logical column
# 8*i + AWQ_PACK_ORDER[j]. Unpacking reads logical column 8*i + c from nibble AWQ_UNPACK_ORDER[c]
# (the inverse permutation: AWQ_PACK_ORDER[AWQ_UNPACK_ORDER[c]] == c).
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# GPTQ v1 stores zero - 1. GPTQModel (the producer transformers uses) converts between v1 and
# v2 by adding/subtracting this constant to whole int32 words, so a zero point of 0 becomes
# nibble 15 and borrows one from the next nibble. Doing the same word arithmetic keeps us
# bit-compatible with it and makes v1 pack/unpack exact inverses for every zero in 0..15.
# (Legacy AutoGPTQ kernels add 1 per nibble instead; they agree for zeros 1..15, which covers
# every symmetric checkpoint, and cannot represent a zero of 0 at all.)
_GPTQ_V1_WORD_OFFSET = 0x11111111

GPTQ_FORMATS = ("gptq", "gptq_v2")
SUPPORTED_GROUP_SIZES_NOTE = "a positive even number (32, 64, 128 are usual)"


@dataclass
class Int4Weight:
    """w[n, k] = (q[n, k] - zero[n, grp(k)]) * scale[n, grp(k)] for an nn.Linear weight [N, K].

    grp(k) is k // group_size, or g_idx[k] when `g_idx` is set (GPTQ act-order / desc_act,
    where input channels were quantized in a permuted order). A group size that does not
    divide K gives ceil(K / group_size) groups, the last one short, as GPTQ makes them. `q`
    stays in logical input order either way. Runtime kernels need `g_idx` None:
    `has_trivial_g_idx` says when a g_idx can be dropped; a non-trivial one must be kept for
    `dequantize` to be right.
    """

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, ceil(K / group_size)]
    zero: torch.Tensor  # float32 [N, ceil(K / group_size)]; integer 0..15 for GPTQ/AWQ
    group_size: int
    g_idx: torch.Tensor | None = None  # int32 [K], group of each input channel

    def __post_init__(self):
        if self.q.dim() != 2 or self.q.dtype != torch.uint8:
            raise ValueError(f"q must be uint8 [N, K], got {self.q.dtype} {list(self.q.shape)}")
        n, k = self.q.shape
        if self.group_size <= 0:
            raise ValueError(f"group_size must be positive, not {self.group_size}")
        groups = [n, -(-k // self.group_size)]
        for name in ("scale", "zero"):
            if list(getattr(self, name).shape) != groups:
                shape = list(getattr(self, name).shape)
                raise ValueError(f"{name} must be [N, ceil(K / G)] = {groups}, got {shape}")
        if self.g_idx is not None and list(self.g_idx.shape) != [k]:
            raise ValueError(f"g_idx must be [K] = [{k}], got {list(self.g_idx.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def group_index(self) -> torch.Tensor:
        """int64 [K]: the group each input channel uses."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        groups = self.group_index()
        scale, zero = self.scale.float()[:, groups], self.zero.float()[:, groups]  # [N, K]
        return (self.q.float() - zero) * scale


def has_trivial_g_idx(g_idx: torch.Tensor | None, group_size: int) -> bool:
    """True when g_idx[k] == k // group_size for every k, so it carries no information."""
    if g_idx is None:
        return True
    return torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group_size)


# ---- bit packing ----------------------------------------------------------------------------


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values taken modulo 2**32 -> the int32 with the same 32 bits (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_last(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> uint8 [..., 8 * M]; nibble j of word i lands at index 8*i + j.

    `>>` on int32 is arithmetic, so a negative word drags copies of its sign bit in from the
    top; the `& 0xF` mask discards them, which makes this correct for all 32-bit patterns.
    """
    return ((words.unsqueeze(-1) >> _SHIFTS) & 0xF).flatten(-2).to(torch.uint8)


def _pack_last(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8 * M] (values 0..15) -> int32 [..., M]; inverse of `_unpack_last`."""
    nibbles = nibbles.to(torch.int64).unflatten(-1, (-1, 8))  # [..., M, 8]
    return _wrap_int32((nibbles << _SHIFTS.to(torch.int64)).sum(-1))


def _check_int4(w: Int4Weight) -> None:
    """Packing needs nibbles and integer zero points in 0..15; anything else would wrap."""
    if int(w.q.max()) > 15:
        raise ValueError(f"q values must be in 0..15, got max {int(w.q.max())}")
    zero = w.zero.float()
    if not torch.equal(zero, zero.round()) or zero.min() < 0 or zero.max() > 15:
        raise ValueError("zero points must be integers in 0..15 to be packed as 4-bit qzeros")


def _to_fp16_scales(scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, G] -> fp16 [G, N] as both formats store them (rounds to fp16)."""
    scales = scale.t().contiguous().to(torch.float16)
    if not torch.isfinite(scales).all():
        raise ValueError("scales overflow fp16; they cannot be stored in a GPTQ/AWQ checkpoint")
    return scales


def _shape_error(what: str, tensor: torch.Tensor, want: list[int], why: str) -> QspecError:
    return QspecError(f"{what} has shape {list(tensor.shape)}, expected {want} ({why})")


def _check_groups(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    in_features: int,
    out_features: int,
) -> tuple[int, str]:
    """The group size, then scales [n_groups, N] and qzeros int32 [n_groups, N/8] against the
    layer qweight holds (GPTQ and AWQ store these two alike); returns (n_groups, the reason
    a shape error gives)."""
    _check_group_size(group_size, in_features)
    n_groups = -(-in_features // group_size)  # (the last group short when G does not divide)
    why = (
        f"qweight {list(qweight.shape)} means in={in_features}, out={out_features}, g={group_size}"
    )
    if list(scales.shape) != [n_groups, out_features]:
        raise _shape_error("scales", scales, [n_groups, out_features], why)
    # (N % 8: GPTQ's zeros pack N into words; AWQ's N is words * 8, so it always passes)
    if out_features % 8 or list(qzeros.shape) != [n_groups, out_features // 8]:
        raise _shape_error("qzeros", qzeros, [n_groups, out_features // 8], why)
    if qzeros.dtype != torch.int32:
        raise QspecError(f"qzeros must be int32, got {qzeros.dtype}")
    return n_groups, why


def _check_group_size(group_size: int, in_features: int) -> None:
    if group_size == -1:
        raise QspecError(
            "group_size -1 (one group per output row) is not supported; "
            f"requantize with group_size {SUPPORTED_GROUP_SIZES_NOTE}"
        )
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise QspecError(
            f"group_size {group_size} is not supported (in_features {in_features}); "
            f"it must be {SUPPORTED_GROUP_SIZES_NOTE}"
        )


# ---- GPTQ -----------------------------------------------------------------------------------


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    sym: bool,
    checkpoint_format: str = "gptq",
) -> Int4Weight:
    """GPTQ tensors of one linear -> Int4Weight (g_idx kept only when it is not trivial).

    `sym` is informational: the stored qzeros are authoritative (symmetric checkpoints store
    zero 8, as 7 in v1).
    """
    if bits != 4:
        raise QspecError(f"only 4-bit GPTQ is supported, this checkpoint has bits={bits}")
    if checkpoint_format not in GPTQ_FORMATS:
        raise QspecError(
            f"unsupported GPTQ checkpoint_format {checkpoint_format!r}; expected one of "
            f"{list(GPTQ_FORMATS)}"
        )
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise QspecError(
            f"qweight must be int32 [K/8, N], got {qweight.dtype} {list(qweight.shape)}"
        )
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    n_groups, why = _check_groups(qweight, qzeros, scales, group_size, in_features, out_features)
    if g_idx is not None:
        if list(g_idx.shape) != [in_features]:
            raise _shape_error("g_idx", g_idx, [in_features], why)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups:
            raise QspecError(f"g_idx values must lie in 0..{n_groups - 1}")

    if checkpoint_format == "gptq":
        qzeros = _wrap_int32(qzeros.to(torch.int64) + _GPTQ_V1_WORD_OFFSET)  # v1 -> v2 words
    q = _unpack_last(qweight.t())  # [N, K]: row n of qweight.t() holds input channels 8i+j
    zero = _unpack_last(qzeros).t().float()  # [N, n_groups]
    g_idx = None if has_trivial_g_idx(g_idx, group_size) else g_idx.to(torch.int32)
    return Int4Weight(
        q=q.contiguous(),
        scale=scales.t().float().contiguous(),
        zero=zero.contiguous(),
        group_size=group_size,
        g_idx=g_idx,
    )


def pack_gptq(w: Int4Weight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Int4Weight -> {qweight, qzeros, scales, g_idx}; the exact inverse of `unpack_gptq`.

    g_idx is always written (k // group_size when `w.g_idx` is None). Scales are rounded to
    fp16, the stored dtype.
    """
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {list(GPTQ_FORMATS)}")
    _check_int4(w)
    out_features, in_features = w.q.shape
    if in_features % 8 or out_features % 8:
        raise ValueError(
            f"GPTQ packing needs N and K divisible by 8, got {[out_features, in_features]}"
        )
    qzeros = _pack_last(w.zero.round().to(torch.uint8).t())  # [n_groups, N/8]
    if checkpoint_format == "gptq":
        qzeros = _wrap_int32(qzeros.to(torch.int64) - _GPTQ_V1_WORD_OFFSET)  # v2 -> v1 words
    g_idx = w.group_index().to(torch.int32)
    return {
        "qweight": _pack_last(w.q).t().contiguous(),  # [K/8, N]
        "qzeros": qzeros,
        "scales": _to_fp16_scales(w.scale),  # [n_groups, N]
        "g_idx": g_idx,
    }


# ---- AWQ ------------------------------------------------------------------------------------


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Weight:
    """AWQ GEMM tensors of one linear -> Int4Weight."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise QspecError(
            f"qweight must be int32 [K, N/8], got {qweight.dtype} {list(qweight.shape)}"
        )
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    _check_groups(qweight, qzeros, scales, group_size, in_features, out_features)

    def unpack_interleaved(words: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack_last(words).unflatten(-1, (-1, 8))  # [rows, N/8, 8] in storage order
        return nibbles[..., list(AWQ_UNPACK_ORDER)].flatten(-2)  # [rows, N] logical order

    return Int4Weight(
        q=unpack_interleaved(qweight).t().contiguous(),  # [N, K]
        scale=scales.t().float().contiguous(),
        zero=unpack_interleaved(qzeros).t().float().contiguous(),
        group_size=group_size,
    )


def pack_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    """Int4Weight -> {qweight, qzeros, scales} in AWQ GEMM layout; inverse of `unpack_awq`."""
    if w.g_idx is not None and not has_trivial_g_idx(w.g_idx, w.group_size):
        raise ValueError("AWQ has no g_idx: a permuted (act-order) weight cannot be stored as AWQ")
    _check_int4(w)
    if w.q.shape[0] % 8:
        raise ValueError(f"AWQ packing needs out_features divisible by 8, got {w.q.shape[0]}")

    def pack_interleaved(logical: torch.Tensor) -> torch.Tensor:
        nibbles = logical.unflatten(-1, (-1, 8))[..., list(AWQ_PACK_ORDER)]  # storage order
        return _pack_last(nibbles.flatten(-2))

    return {
        "qweight": pack_interleaved(w.q.t()),  # [K, N/8]
        "qzeros": pack_interleaved(w.zero.round().to(torch.uint8).t()),  # [K/g, N/8]
        "scales": _to_fp16_scales(w.scale),  # [K/g, N]
    }


# ---- checkpoint folders ---------------------------------------------------------------------


@dataclass(frozen=True)
class QuantInfo:
    """The quantization settings a checkpoint folder declares."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" | "gptq_v2" for GPTQ, "gemm" for AWQ
    source: Path  # the JSON file the settings came from


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QspecError(f"cannot read {path}: {e}") from None


def read_quant_info(folder: Path) -> QuantInfo:
    """Settings from config.json's `quantization_config`, else from `quantize_config.json`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QspecError(f"quantized checkpoint folder {folder} does not exist")
    config_path, quant_path = folder / "config.json", folder / "quantize_config.json"
    cfg = None
    if config_path.exists():
        cfg, source = _read_json(config_path).get("quantization_config"), config_path
    if cfg is None and quant_path.exists():
        # AutoGPTQ's quantize_config.json predates the quant_method key: it is always GPTQ.
        cfg, source = {"quant_method": "gptq", **_read_json(quant_path)}, quant_path
    if not isinstance(cfg, dict):
        raise QspecError(
            f"{folder} is not a quantized checkpoint: no quantization_config in config.json "
            "and no quantize_config.json"
        )

    method = str(cfg.get("quant_method", "")).lower()
    bits = cfg.get("bits", cfg.get("w_bit"))
    group_size = cfg.get("group_size", cfg.get("q_group_size"))
    if method not in ("gptq", "awq"):
        raise QspecError(f"unknown quant_method {method!r} in {source}; expected 'gptq' or 'awq'")
    if bits != 4:
        raise QspecError(f"only 4-bit checkpoints are supported, {source} says bits={bits}")
    if group_size is None:
        raise QspecError(f"{source} has no group_size")
    if group_size == -1:
        raise QspecError(
            f"{source}: group_size -1 (one group per output row) is not supported; "
            f"use group_size {SUPPORTED_GROUP_SIZES_NOTE}"
        )
    if not isinstance(group_size, int) or group_size <= 0:
        raise QspecError(f"{source}: invalid group_size {group_size!r}")

    if method == "gptq":
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS:
            raise QspecError(
                f"{source}: unsupported GPTQ checkpoint_format {fmt!r}; "
                f"expected one of {list(GPTQ_FORMATS)}"
            )
        sym, desc_act = bool(cfg.get("sym", True)), bool(cfg.get("desc_act", False))
    else:
        fmt = str(cfg.get("version", "gemm")).lower()
        if fmt != "gemm":
            raise QspecError(
                f"{source}: AWQ version {cfg.get('version')!r} is not supported; "
                "only 'gemm' checkpoints are"
            )
        if not cfg.get("zero_point", True):
            raise QspecError(f"{source}: AWQ without zero_point is not supported")
        sym, desc_act = False, False
    return QuantInfo(method, bits, group_size, sym, desc_act, fmt, source)


_QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def read_quantized_checkpoint(
    folder: Path,
) -> tuple[QuantInfo, dict[str, Int4Weight], dict[str, torch.Tensor]]:
    """(settings, quantized linears by module name, all other tensors), `model.` stripped.

    Module names drop the `.qweight` suffix: "layers.0.self_attn.q_proj", "lm_head".
    """
    folder = Path(folder)
    info = read_quant_info(folder)
    state = load_state_dict(folder)
    modules = sorted(name.removesuffix(".qweight") for name in state if name.endswith(".qweight"))
    if not modules:
        raise QspecError(
            f"{folder} declares {info.method} quantization but has no .qweight tensors"
        )

    weights: dict[str, Int4Weight] = {}
    for module in modules:
        missing = [s for s in (".qzeros", ".scales") if module + s not in state]
        if missing:
            raise QspecError(f"{folder}: {module} has a qweight but no {', '.join(missing)}")
        qweight, qzeros = state.pop(module + ".qweight"), state.pop(module + ".qzeros")
        scales, g_idx = state.pop(module + ".scales"), state.pop(module + ".g_idx", None)
        try:
            if info.method == "gptq":
                weights[module] = unpack_gptq(
                    qweight, qzeros, scales, g_idx, bits=info.bits, group_size=info.group_size,
                    sym=info.sym, checkpoint_format=info.checkpoint_format,
                )  # fmt: skip
            else:
                weights[module] = unpack_awq(qweight, qzeros, scales, info.group_size)
        except QspecError as e:
            raise QspecError(f"{folder}: {module}: {e}") from None

    orphans = [name for name in state if name.endswith(_QUANT_SUFFIXES[1:])]
    if orphans:
        raise QspecError(f"{folder}: {orphans[0]} has no matching .qweight")
    return info, weights, state


def _hf_name(name: str) -> str:
    """Our stripped names -> checkpoint names: HF keeps lm_head outside the `model.` prefix."""
    return name if name.split(".")[0] == "lm_head" else f"model.{name}"


def write_gptq_checkpoint(
    folder: Path,
    weights: dict[str, Int4Weight],
    other: dict[str, torch.Tensor],
    hf_config: dict,
    sym: bool,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
) -> Path:
    """Write a GPTQ folder (model.safetensors, config.json, quantize_config.json) atomically.

    Files are written into a temporary sibling folder that is renamed into place, so a crash
    never leaves a half-written checkpoint. An existing non-empty `folder` is refused.
    """
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise QspecError(f"refusing to overwrite {folder}: it exists and is not empty")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {list(GPTQ_FORMATS)}")
    if not weights:
        raise ValueError("no quantized weights to write")
    group_sizes = {w.group_size for w in weights.values()}
    if len(group_sizes) != 1:
        raise ValueError(f"one group_size per checkpoint, got {sorted(group_sizes)}")
    group_size = group_sizes.pop()

    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not desc_act and not has_trivial_g_idx(w.g_idx, group_size):
            raise ValueError(f"{name} has a permuted g_idx: write it with desc_act=True")
        if sym and not bool((w.zero == 8).all()):
            raise ValueError(f"{name}: sym=True needs every zero point to be 8")
        for key, tensor in pack_gptq(w, checkpoint_format).items():
            tensors[f"{_hf_name(name)}.{key}"] = tensor
    for name, tensor in other.items():
        # clone: safetensors refuses tensors that share storage (tied embeddings)
        tensors[_hf_name(name)] = tensor.detach().contiguous().clone()

    quant_config = {
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": False,  # qspec collects all Hessians in one pass
        "static_groups": False,
        "lm_head": any(name.split(".")[0] == "lm_head" for name in weights),
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
        "meta": {"quantizer": "qspec"},
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = {**hf_config, "quantization_config": quant_config}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "quantize_config.json").write_text(json.dumps(quant_config, indent=2) + "\n")
        if folder.exists():
            folder.rmdir()  # empty (checked above); rename cannot replace a directory
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
