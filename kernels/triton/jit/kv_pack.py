"""The quantize-and-pack kernels and their launch (the host half, with the argument checks
and the dispatch: `kernels.triton.kv_pack`). Bit for bit the twins' exact fp32 operations
(`kernels.planes.quantize_keys` / `quantize_values`):

- divisions are IEEE (`tl.math.div_rn`; a plain `/` may compile to an approximate divide);
- `U * s + zero` is a rounded multiply then a rounded add (launched with
  `enable_fp_fusion=False`, so no FMA contraction on GPUs);
- rounding is half to even, like torch.round (`_round_half_even`; libdevice's rint has no
  interpreter implementation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.planes import LOWER_OFFSET, QuantizedGroupTensor
from kernels.triton.jit.common import interpreted

_LOWER_OFFSET = tl.constexpr(LOWER_OFFSET)  # jit code reads only constexpr globals


@triton.jit
def _round_half_even(y):
    """Nearest integer, ties to even (torch.round), for any finite fp32 y. y - floor(y) is
    exact in fp32, so the tie test is exact; |y| >= 2**23 is already an integer."""
    low = tl.floor(y)
    frac = y - low
    low_is_odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & low_is_odd)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _quantize(x, zero, scale):
    """kernels.planes._quantize_groups after the min/max: x fp32, zero/scale broadcastable to it.
    Returns the upper (0..15) and stored lower (L + 8, 0..15) codes as uint8."""
    lower_step = tl.math.div_rn(scale, 16.0)
    safe_scale = tl.where(scale > 0, scale, 1.0)  # zero-range group: U = 0, L = 0
    safe_lower_step = tl.where(lower_step > 0, lower_step, 1.0)  # s / 16 may underflow
    upper = _round_half_even(tl.math.div_rn(x - zero, safe_scale))
    upper = tl.minimum(tl.maximum(upper, 0.0), 15.0)
    residual = x - (upper * scale + zero)
    lower = _round_half_even(tl.math.div_rn(residual, safe_lower_step))
    lower = tl.minimum(tl.maximum(lower, -8.0), 7.0)
    return upper.to(tl.uint8), (lower + _LOWER_OFFSET).to(tl.uint8)


@triton.jit
def _pack(even, odd):
    """Two nibble codes (uint8 0..15) -> one byte: even channel low, odd channel high."""
    return even | (odd << 4)


@triton.jit
def _key_pack_kernel(
    k_ptr,  # [B, n_kv, T, D]
    upper_ptr, lower_ptr,  # [B, n_kv, T, D/2] uint8
    scale_ptr, zero_ptr,  # [B, n_kv, T/G, D] fp32
    n_kv, T, stride_kb, stride_kh, stride_kt,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One program per (b, kv head, token group): the group's [G, D] keys, min/max per
    channel. Even and odd channels are loaded as separate [G, D/2] tiles, so each output byte
    is formed from two tiles of the same shape with no reshuffle."""
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a long prefill passes 2**31
    group = tl.program_id(1)
    b = pid_bh // n_kv
    h = pid_bh % n_kv
    HALF: tl.constexpr = HEAD_DIM // 2
    tokens = group * GROUP_SIZE + tl.arange(0, GROUP_SIZE)  # [G]
    pairs = tl.arange(0, HALF)  # [D/2] byte index j: channels 2j, 2j + 1
    src = k_ptr + b * stride_kb + h * stride_kh + tokens[:, None] * stride_kt  # [G, 1]
    x_even = tl.load(src + 2 * pairs[None, :]).to(tl.float32)  # [G, D/2]
    x_odd = tl.load(src + 2 * pairs[None, :] + 1).to(tl.float32)

    zero_even = tl.min(x_even, 0)  # [D/2]
    zero_odd = tl.min(x_odd, 0)
    scale_even = tl.math.div_rn(tl.max(x_even, 0) - zero_even, 15.0)
    scale_odd = tl.math.div_rn(tl.max(x_odd, 0) - zero_odd, 15.0)
    upper_even, lower_even = _quantize(x_even, zero_even[None, :], scale_even[None, :])
    upper_odd, lower_odd = _quantize(x_odd, zero_odd[None, :], scale_odd[None, :])

    row = pid_bh * T + tokens  # [G] rows of the contiguous outputs, [B * n_kv * T, ...]
    dst = row[:, None] * HALF + pairs[None, :]  # [G, D/2]
    tl.store(upper_ptr + dst, _pack(upper_even, upper_odd))
    tl.store(lower_ptr + dst, _pack(lower_even, lower_odd))
    meta = (pid_bh * (T // GROUP_SIZE) + group) * HEAD_DIM + 2 * pairs  # [D/2] even channels
    tl.store(scale_ptr + meta, scale_even)
    tl.store(scale_ptr + meta + 1, scale_odd)
    tl.store(zero_ptr + meta, zero_even)
    tl.store(zero_ptr + meta + 1, zero_odd)


@triton.jit
def _value_pack_kernel(
    v_ptr,  # [B, n_kv, T, D]
    upper_ptr, lower_ptr,  # [B, n_kv, T, D/2] uint8
    scale_ptr, zero_ptr,  # [B, n_kv, T, D/G] fp32
    n_kv, T, stride_vb, stride_vh, stride_vt,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One program per (b, kv head, BLOCK_T tokens); min/max per token over each group of G
    channels, one channel group at a time (even and odd channels as [BLOCK_T, G/2] tiles)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // n_kv
    h = pid_bh % n_kv
    HALF_G: tl.constexpr = GROUP_SIZE // 2
    N_GROUPS: tl.constexpr = HEAD_DIM // GROUP_SIZE
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    token_ok = tokens < T
    row = pid_bh * T + tokens  # [BT] rows of the contiguous outputs
    src = v_ptr + b * stride_vb + h * stride_vh + tokens[:, None] * stride_vt  # [BT, 1]
    for g in tl.static_range(N_GROUPS):
        pairs = g * HALF_G + tl.arange(0, HALF_G)  # [G/2] byte index j: channels 2j, 2j + 1
        x_even = tl.load(src + 2 * pairs[None, :], mask=token_ok[:, None], other=0.0)
        x_odd = tl.load(src + 2 * pairs[None, :] + 1, mask=token_ok[:, None], other=0.0)
        x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
        zero = tl.minimum(tl.min(x_even, 1), tl.min(x_odd, 1))  # [BT]
        scale = tl.math.div_rn(tl.maximum(tl.max(x_even, 1), tl.max(x_odd, 1)) - zero, 15.0)
        upper_even, lower_even = _quantize(x_even, zero[:, None], scale[:, None])
        upper_odd, lower_odd = _quantize(x_odd, zero[:, None], scale[:, None])
        dst = row[:, None] * (HEAD_DIM // 2) + pairs[None, :]  # [BT, G/2]
        tl.store(upper_ptr + dst, _pack(upper_even, upper_odd), mask=token_ok[:, None])
        tl.store(lower_ptr + dst, _pack(lower_even, lower_odd), mask=token_ok[:, None])
        tl.store(scale_ptr + row * N_GROUPS + g, scale, mask=token_ok)
        tl.store(zero_ptr + row * N_GROUPS + g, zero, mask=token_ok)


INTERPRETED = interpreted(_key_pack_kernel)  # (`kernels.triton.runs.kernel_runs_on`)


# ---------------------------------------------------------------------------------------------
# Launch


def _outputs(x: torch.Tensor, meta_shape: tuple[int, ...]) -> QuantizedGroupTensor:
    B, n_kv, T, D = x.shape
    planes = (B, n_kv, T, D // 2)
    return QuantizedGroupTensor(
        upper=torch.empty(planes, dtype=torch.uint8, device=x.device),
        lower=torch.empty(planes, dtype=torch.uint8, device=x.device),
        scale=torch.empty(meta_shape, dtype=torch.float32, device=x.device),
        zero=torch.empty(meta_shape, dtype=torch.float32, device=x.device),
    )


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_keys(k: torch.Tensor, group_size: int) -> QuantizedGroupTensor:
    """Keys [B, n_kv, T, D] as checked by the host (`kernels.triton.kv_pack._launch_keys`)."""
    B, n_kv, T, D = k.shape
    out = _outputs(k, (B, n_kv, T // group_size, D))
    if out.upper.numel() == 0:
        return out
    k = _unit_last_stride(k)
    _key_pack_kernel[(B * n_kv, T // group_size)](
        k, out.upper, out.lower, out.scale, out.zero, n_kv, T, *k.stride()[:3],
        GROUP_SIZE=group_size, HEAD_DIM=D, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def launch_values(v: torch.Tensor, G: int) -> QuantizedGroupTensor:
    """Values [B, n_kv, T, D], G channels a group, as checked by the host
    (`kernels.triton.kv_pack._launch_values`)."""
    B, n_kv, T, D = v.shape
    out = _outputs(v, (B, n_kv, T, D // G))
    if out.upper.numel() == 0:
        return out
    v = _unit_last_stride(v)
    block_t = 32 if v.is_cuda else 64  # the interpreter pays per program
    _value_pack_kernel[(B * n_kv, triton.cdiv(T, block_t))](
        v, out.upper, out.lower, out.scale, out.zero, n_kv, T, *v.stride()[:3],
        GROUP_SIZE=G, HEAD_DIM=D, BLOCK_T=block_t, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
