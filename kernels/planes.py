"""The hierarchical INT4/INT8 KV plane format (QuantSpec, design section 2): its PyTorch
reference (quantize, dequantize, byte accounting) and the named per-layer view of the cache
that the attention kernels read (`HierLayerView`, `QueryRows`).

One cache, two views. For each group x with mn = min(x), mx = max(x):

    s = (mx - mn) / 15                          # upper scale (asymmetric, zero = mn)
    U = clamp(round((x - mn) / s), 0, 15)       # upper plane
    r = x - (U * s + mn)                        # residual, in [-s/2, s/2]
    L = clamp(round(r / (s / 16)), -8, 7)       # lower plane (symmetric)
    "int4" : U * s + mn                         # the upper plane only (the draft's view)
    "int8" : (16 * U + L) * (s / 16) + mn       # INT8 code 16U + L, no extra metadata

Grouping follows KIVI/QuantSpec: keys per channel (one (scale, zero) per channel per group of
G consecutive tokens), values per token (one (scale, zero) per token per group of G channels).
Both planes are packed two nibbles per byte along head_dim, so a kernel reading one token's
vector reads D/2 contiguous bytes per plane.

Known limit of the paper's formula: L has 16 levels (-8..7) but r / (s/16) spans [-8, 8]. A
residual in (15s/32, s/2] rounds to +8 and clamps to 7, so the INT8 error there reaches
s/16 instead of s/32 (about 1/32 of elements on smooth data). We keep the formula as written
(C_INT8 = 2^4 C_U + C_L, lower plane symmetric) rather than invent a different lower scale.

Rounding is torch.round (half to even); a kernel that quantizes must do the same to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VIEWS = ("int8", "int4")  # the KV views: both planes, or the upper plane only
LOWER_OFFSET = 8  # lower plane L in -8..7 is stored as L + 8 in 0..15


@dataclass
class QuantizedGroupTensor:
    """Packed planes plus per-group metadata of one quantized K or V tensor.

    Keys:   upper/lower [B, n_kv, T, D//2] uint8, scale/zero [B, n_kv, T//G, D] fp32.
    Values: upper/lower [B, n_kv, T, D//2] uint8, scale/zero [B, n_kv, T, D//G] fp32.
    Scales and zeros are fp32, not fp16: the INT8 view resolves s/16 steps on top of
    `zero`, and fp16 metadata would add error of that order for large-magnitude groups.
    Their bytes are counted in `nbytes` and `kv_bytes_per_token`.
    """

    upper: torch.Tensor  # packed U, 0..15
    lower: torch.Tensor  # packed L + 8, 0..15
    scale: torch.Tensor  # s = (max - min) / 15
    zero: torch.Tensor  # the group min

    @property
    def nbytes(self) -> int:
        """Bytes held by both planes and the metadata (what the INT8 view reads)."""
        return sum(
            t.numel() * t.element_size() for t in (self.upper, self.lower, self.scale, self.zero)
        )


# ---------------------------------------------------------------------------------------------
# Nibble packing


def pack_nibbles(x: torch.Tensor) -> torch.Tensor:
    """Pack uint8 values 0..15 [..., n] into bytes [..., n//2]: element 2i low, 2i+1 high."""
    if x.dtype != torch.uint8:
        raise ValueError(f"pack_nibbles expects uint8, got {x.dtype}")
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"pack_nibbles needs an even last dim, got {x.shape[-1]}")
    if x.numel() and int(x.max()) > 15:
        raise ValueError("pack_nibbles expects values in 0..15")
    low, high = x[..., 0::2], x[..., 1::2]  # [..., n//2] each
    return low | (high << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: bytes [..., m] -> uint8 values 0..15 [..., 2m]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_nibbles expects uint8, got {packed.dtype}")
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)  # [..., m, 2] -> [..., 2m]


# ---------------------------------------------------------------------------------------------
# Group math (layout-free: the group is the dimension `dim`)


def _check_finite(x: torch.Tensor, name: str) -> None:
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains inf or nan; the KV quantizer needs finite values")


def _quantize_groups(
    x: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize fp32 `x` in groups along `dim`. Returns U (uint8), L (int8), scale, zero.

    U and L have x's shape; scale and zero keep `dim` with size 1 (for broadcasting).
    """
    zero = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - zero) / 15
    if not torch.isfinite(scale).all():
        raise ValueError("a KV group's value range (max - min) overflows fp32")
    # Zero-range groups have s == 0: divide by 1 instead, which gives U = 0, r = 0, L = 0 and
    # reconstructs exactly `zero`. The lower step is guarded separately because s / 16 can
    # underflow to 0 for a subnormal s.
    lower_step = scale / 16
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    safe_lower_step = torch.where(lower_step > 0, lower_step, torch.ones_like(lower_step))
    upper = torch.clamp(torch.round((x - zero) / safe_scale), 0, 15)
    residual = x - (upper * scale + zero)
    lower = torch.clamp(torch.round(residual / safe_lower_step), -8, 7)
    return upper.to(torch.uint8), lower.to(torch.int8), scale, zero


def _dequantize_groups(
    q: QuantizedGroupTensor, grouped: tuple[int, ...], group_dim: int, view: str
) -> torch.Tensor:
    """q's codes reshaped to `grouped` (a group's members along `group_dim`, where its scale
    and zero broadcast) and dequantized: the INT4 view from the upper plane alone, the INT8
    view from both; all math in fp32."""
    upper = unpack_nibbles(q.upper).reshape(grouped).float()
    scale, zero = q.scale.unsqueeze(group_dim), q.zero.unsqueeze(group_dim)
    if view == "int4":
        return upper * scale + zero
    lower = unpack_nibbles(q.lower).reshape(grouped).to(torch.int8) - LOWER_OFFSET
    return (16 * upper + lower.float()) * (scale / 16) + zero


def check_view(view: str) -> None:
    """ValueError unless `view` names a KV view ("int8" or "int4")."""
    if view not in VIEWS:
        raise ValueError(f"the KV view must be one of {VIEWS}, got {view!r}")


def _check_kv(x: torch.Tensor, name: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be [B, n_kv, T, D], got shape {tuple(x.shape)}")
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"{name} head_dim must be even for nibble packing, got {x.shape[-1]}")
    _check_finite(x, name)


# ---------------------------------------------------------------------------------------------
# Keys: per-channel groups of G consecutive tokens


def quantize_keys(k: torch.Tensor, group_size: int) -> QuantizedGroupTensor:
    """Quantize keys [B, n_kv, T, D] per channel over groups of `group_size` tokens.

    T must be a multiple of the group size: a key group is quantized only once all of its
    tokens exist (the rest waits in the full-precision buffer).
    """
    _check_kv(k, "keys")
    B, n_kv, T, D = k.shape
    if group_size < 1 or T % group_size != 0:
        raise ValueError(f"keys: T={T} must be a multiple of group_size={group_size}")
    grouped = k.float().reshape(B, n_kv, T // group_size, group_size, D)
    upper, lower, scale, zero = _quantize_groups(grouped, dim=3)  # scale [B, n_kv, T//G, 1, D]
    return QuantizedGroupTensor(
        upper=pack_nibbles(upper.reshape(B, n_kv, T, D)),  # [B, n_kv, T, D//2]
        lower=pack_nibbles((lower + LOWER_OFFSET).to(torch.uint8).reshape(B, n_kv, T, D)),
        scale=scale.squeeze(3),  # [B, n_kv, T//G, D]
        zero=zero.squeeze(3),
    )


def dequantize_keys(q: QuantizedGroupTensor, group_size: int, view: str) -> torch.Tensor:
    """Keys in the `view` ("int8" or "int4") as fp32 [B, n_kv, T, D]."""
    check_view(view)
    B, n_kv, T, half_d = q.upper.shape
    D = 2 * half_d
    if group_size < 1 or q.scale.shape != (B, n_kv, T // group_size, D) or T % group_size:
        raise ValueError(f"keys: metadata {tuple(q.scale.shape)} does not match G={group_size}")
    grouped = (B, n_kv, T // group_size, group_size, D)
    out = _dequantize_groups(q, grouped, 3, view)
    return out.reshape(B, n_kv, T, D)


# ---------------------------------------------------------------------------------------------
# Values: per-token groups of G channels


def quantize_values(v: torch.Tensor, group_size: int | None = None) -> QuantizedGroupTensor:
    """Quantize values [B, n_kv, T, D] per token over groups of `group_size` channels (D)."""
    _check_kv(v, "values")
    B, n_kv, T, D = v.shape
    G = D if group_size is None else group_size
    if G < 1 or D % G != 0:
        raise ValueError(f"values: group_size={G} must divide head_dim={D}")
    grouped = v.float().reshape(B, n_kv, T, D // G, G)
    upper, lower, scale, zero = _quantize_groups(grouped, dim=4)  # scale [B, n_kv, T, D//G, 1]
    return QuantizedGroupTensor(
        upper=pack_nibbles(upper.reshape(B, n_kv, T, D)),  # [B, n_kv, T, D//2]
        lower=pack_nibbles((lower + LOWER_OFFSET).to(torch.uint8).reshape(B, n_kv, T, D)),
        scale=scale.squeeze(4),  # [B, n_kv, T, D//G]
        zero=zero.squeeze(4),
    )


def dequantize_values(
    q: QuantizedGroupTensor, group_size: int | None = None, view: str = "int8"
) -> torch.Tensor:
    """Values in the `view` ("int8" or "int4") as fp32 [B, n_kv, T, D]."""
    check_view(view)
    B, n_kv, T, half_d = q.upper.shape
    D = 2 * half_d
    G = D if group_size is None else group_size
    if G < 1 or D % G != 0 or q.scale.shape != (B, n_kv, T, D // G):
        raise ValueError(f"values: metadata {tuple(q.scale.shape)} does not match G={G}")
    grouped = (B, n_kv, T, D // G, G)
    out = _dequantize_groups(q, grouped, 4, view)
    return out.reshape(B, n_kv, T, D)


# ---------------------------------------------------------------------------------------------
# Memory accounting


@dataclass(frozen=True)
class KVBytes:
    """Bytes one view reads per token per KV head, K and V together."""

    payload: float  # packed nibbles
    metadata: float  # fp32 scale + zero, amortized over the group

    @property
    def total(self) -> float:
        return self.payload + self.metadata


def kv_bytes_per_token(
    head_dim: int,
    view: str,
    key_group_size: int | None = None,
    value_group_size: int | None = None,
) -> KVBytes:
    """Bytes per token per KV head of the quantized history in `view` (K + V).

    "int4" reads the upper plane (D/2 bytes per tensor); "int8" reads both (D bytes). Both
    read the metadata: keys hold 2 fp32 per channel per G_k tokens (8*D/G_k bytes per
    token), values 2 fp32 per G_v channels of each token (8*D/G_v). No padding: D is even,
    key groups are whole, G_v divides D. Group sizes default to head_dim (the paper's G).
    Covers the quantized history only, not the full-precision recent buffer.
    """
    check_view(view)
    g_k = head_dim if key_group_size is None else key_group_size
    g_v = head_dim if value_group_size is None else value_group_size
    planes = 1 if view == "int4" else 2
    payload = 2 * planes * head_dim / 2  # (K and V) x planes x D nibbles
    metadata = 2 * 4 * head_dim / g_k + 2 * 4 * head_dim / g_v  # (scale, zero) fp32
    return KVBytes(payload=payload, metadata=metadata)


# ---------------------------------------------------------------------------------------------
# What the attention kernels read: one layer of the cache, and the per-query visibility


@dataclass(frozen=True)
class HierLayerView:
    """One layer of the hierarchical cache, as stored (slices of the cache's buffers, no copy).

    Planes k_upper/k_lower/v_upper/v_lower [B, n_kv, S, D/2] uint8 (S: the planes' capacity;
    only the history a query sees is read); k_scale/k_zero [B, n_kv, S/G, D] fp32 (keys per
    channel per G tokens); v_scale/v_zero [B, n_kv, S, D/G] fp32 (values per token per G
    channels); fp_k/fp_v [B, n_kv, F, D] (fp32 or bf16) the full-precision region, positions
    fp_pos0 .. fp_pos0 + F - 1, where fp_pos0 is the layer's quantized length n_quant.
    """

    k_upper: torch.Tensor
    k_lower: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_upper: torch.Tensor
    v_lower: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    fp_k: torch.Tensor
    fp_v: torch.Tensor
    fp_pos0: int
    group_size: int

    def check(self, q: torch.Tensor, kv: str) -> None:
        """ValueError unless q [B, H, T, D] and the KV view `kv` fit this layer's shapes."""
        check_view(kv)
        B, H, T, D = q.shape
        G, n_kv = self.group_size, self.k_upper.shape[1]
        if H % n_kv:
            raise ValueError(f"{H} query heads are not a multiple of {n_kv} KV heads")
        if self.k_upper.shape[:2] != (B, n_kv) or self.k_upper.shape[3] * 2 != D:
            raise ValueError(f"planes {tuple(self.k_upper.shape)} do not match q {tuple(q.shape)}")
        if D % G or G % 2:
            raise ValueError(f"group size {G} must be even and divide head_dim {D}")
        S = self.k_upper.shape[2]
        if self.k_scale.shape != (B, n_kv, S // G, D):
            raise ValueError(f"k_scale {tuple(self.k_scale.shape)} does not match G = {G}")
        if self.v_scale.shape != (B, n_kv, S, D // G):
            raise ValueError(f"v_scale {tuple(self.v_scale.shape)} does not match G = {G}")
        fp_k, fp_v = self.fp_k, self.fp_v
        if fp_k.shape[:2] != (B, n_kv) or fp_k.shape[3] != D or fp_v.shape != fp_k.shape:
            raise ValueError(f"fp_k/fp_v {tuple(fp_k.shape)} do not match q {tuple(q.shape)}")


@dataclass(frozen=True)
class QueryRows:
    """Which keys each of T queries sees (tensors or sequences of T ints; on the CPU, a kernel
    reads them without a device sync). Query t at position input_pos[t] sees

    - history key j (position j) iff j < n_quant_q[t] (a multiple of G);
    - full-precision key j (position fp_pos0 + j) iff fp_lo[t] <= j and fp_pos0 + j <=
      input_pos[t].

    Per-query n_quant_q / fp_lo serve the cache's "late" queries, which see the oldest G
    full-precision tokens (F1) as quantized history instead, staged in the planes' next slot
    (n_quant_q = n_quant + G, fp_lo = G); every other query has n_quant_q = n_quant, fp_lo = 0.

    `parents` [T] (None: a chain, as above) makes the T queries a token tree, the verify of
    several candidate continuations at once: the queries' own K/V sit at region slots w .. w +
    T - 1 (w = input_pos[0] - fp_pos0, query t's at w + t) while their positions are their
    depths (input_pos[t] = input_pos[parents[t]] + 1; -1 marks a root, at input_pos[0]).
    Query t sees the region keys before w (from fp_lo[t] on) and, of the queries' own, only
    its ancestors' and its own: what the chain token at its position sees, in the same order.

    `window` (None: no limit) is a local layer's sliding window, transformers'
    `sliding_window`: of the keys above, query t sees only those at positions > input_pos[t] -
    window (its last `window` positions, its own included). A history key's position is its
    index j, a region key's fp_pos0 + j, a tree row's its depth's.
    """

    n_quant_q: torch.Tensor
    fp_lo: torch.Tensor
    input_pos: torch.Tensor
    parents: torch.Tensor | None = None
    window: int | None = None

    def index(self, T: int) -> torch.Tensor:
        """The three vectors as one int64 CPU tensor [3, T] (rows: n_quant_q, input_pos,
        fp_lo): one host copy serves a grid size and one upload."""
        rows = [
            torch.as_tensor(x).reshape(-1).to("cpu", torch.int64)
            for x in (self.n_quant_q, self.input_pos, self.fp_lo)
        ]
        for name, row in zip(("n_quant_q", "input_pos", "fp_lo"), rows, strict=True):
            if row.numel() != T:
                raise ValueError(
                    f"{name} must have one entry per query (T = {T}), got {row.numel()}"
                )
        return torch.stack(rows)
