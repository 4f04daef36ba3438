"""The quantized weight formats and their PyTorch references (pack, unpack, (de)quantize).

INT4 (the draft's W4A16, group-quantized, asymmetric):

    W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G],   q in 0..15

  stored as `packed` uint8 [N, K // 2], two nibbles per byte along K: element k = 2i in the
  LOW nibble of byte i, k = 2i + 1 in the HIGH nibble; scale/zero [N, K // G] (fp32 or the
  activation dtype), zero a float zero point (may be fractional).

INT8 (the verifier's W8A16, per output channel, symmetric):

    W[n, k] = q[n, k] * scale[n],   q in -127..127 (int8 [N, K]), scale fp32 [N]

The Triton kernels (`kernels/triton/w4a16.py`, `w8a16.py`) and the CPU kernels
(`kernels/cpu/linear.py`) read these layouts; their tests dequantize with the functions here.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------
# INT4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] with values 0..15 -> uint8 [N, K // 2] (k = 2i low nibble, 2i + 1 high)."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4 wants uint8 [N, even K], got {q.dtype} {tuple(q.shape)}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError("pack_int4: values must lie in 0..15")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K], the inverse of `pack_int4`."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 wants uint8 [N, K // 2], got {packed.dtype}")
    low = packed & 0xF  # [N, K // 2], elements k = 2i
    high = packed >> 4  # [N, K // 2], elements k = 2i + 1
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (unpacked), scale/zero [N, K/G] -> fp32 [N, K]."""
    N, K = q.shape
    G = K // scale.shape[1]
    w = (q.float().reshape(N, -1, G) - zero[..., None]) * scale[..., None]
    return w.reshape(N, K)


# ---------------------------------------------------------------------------------------------
# INT8


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: weight [N, K] -> (q int8 [N, K], scale fp32 [N]).

    scale[n] = max_k |weight[n, k]| / 127 and q = clamp(round(weight / scale), -127, 127), so
    |weight - q * scale| <= scale / 2 per row. A row that is all zeros (or whose max is so
    small that max / 127 underflows) gets scale 1 and q = 0: it dequantizes to exact zeros
    instead of 0 / 0 = NaN. -128 is never produced, so the grid stays symmetric around 0.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8 wants a float [N, K], got {weight.dtype} {weight.shape}")
    w = weight.detach().float()  # [N, K]
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_int8: weight has inf or NaN entries")
    scale = w.abs().amax(dim=1) / 127  # [N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127)  # [N, K]
    return q.to(torch.int8).contiguous(), scale.contiguous()


def dequantize_int8(w_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] and scale [N] -> the fp32 weight [N, K] they represent."""
    return w_int8.float() * scale.float()[:, None]


ACT_CHUNK = 64  # inputs per int8 activation step (W8A8 target, W4A8 draft)
ACT_MIN_AMAX = 1e-30  # a chunk of smaller activations rounds to zero (127 / amax overflows)
QUERY_LEVELS = 32767  # the attention's integer queries are int16 (`kernels/cpu/attention_int.h`)
QUERY_MAX_DIM = 256  # head_dim at most, so that a key's integer dot fits int32 (255 * 32767 * D)


def round_symmetric(
    x: torch.Tensor, chunk: int = ACT_CHUNK, levels: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded to integers in -levels..levels per `chunk` entries of the last dim (symmetric,
    step max|x| / levels, ties to even): (codes [..., n / chunk, chunk] as fp32 integers, step
    [..., n / chunk, 1]). levels 127: int8 codes (activations); 32767: int16 (the attention's
    queries). A chunk with max |x| below ACT_MIN_AMAX gets zeros and step 0; a NaN or an
    infinity gives a NaN step (and NaN codes where x is NaN or infinite). The twin of the C++
    kernels' `round_to_codes` (`kernels/cpu/isa.h`)."""
    chunks = x.float().reshape(*x.shape[:-1], -1, chunk)
    amax = chunks.abs().amax(-1, keepdim=True)
    amax = torch.where(amax.isinf(), float("nan"), amax)  # (an infinity is treated as a NaN)
    # L / amax divided once (as the C++ kernels do): `127.0 / tensor` is reciprocal-then-
    # multiply in PyTorch, an ulp off at times, which moved a near-tie code by one
    small = ~(amax >= ACT_MIN_AMAX)  # (NaN included: its chunk's x * 0 stays NaN below)
    inv = torch.where(small, torch.zeros_like(amax), torch.full_like(amax, float(levels)) / amax)
    step = torch.where(small & ~amax.isnan(), torch.zeros_like(amax), amax / float(levels))
    return torch.round(chunks * inv), step


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per 64 inputs along the last dim (`round_symmetric`), dequantized
    in fp32: the activations the W8A8 target and the W4A8 draft multiply
    (`kernels/cpu/int_dot.cpp` rounds them the same way). The last dim must be a multiple of
    64. A chunk with max |x| below ACT_MIN_AMAX becomes zeros; a NaN stays NaN."""
    codes, step = round_symmetric(x)
    return (codes * step).reshape(x.shape)
