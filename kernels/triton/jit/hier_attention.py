"""The flash-decoding kernels over the hierarchical cache and their launch (the host half,
with the arguments, the checks and the dispatch: `kernels.triton.hier_attention`)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.planes import LOWER_OFFSET, HierLayerView, QueryRows
from kernels.triton.jit.common import interpreted, round_to_bf16_grid

# Row max before any key is seen. Finite, so that exp2(m_old - m_new) of a row that has seen
# nothing yet is exp2(0) = 1 instead of exp2(-inf + inf) = NaN; fully masked rows keep
# l = 0 and acc = 0 and come out as zeros.
_NO_SCORE = tl.constexpr(-1.0e30)
_LOWER_OFFSET = tl.constexpr(LOWER_OFFSET)  # jit code reads only constexpr globals
_LOG2E = 1.4426950408889634
# A global layer's window: more positions than any context, so pos - window hides no key
# (the kernel takes the window as a runtime int32 and one compile serves both layer kinds).
NO_WINDOW = 1 << 30


# ---------------------------------------------------------------------------------------------
# Triton kernels
#
# Design:
# - Grid (B * n_kv, n_chunks + 1). Program (bh, c) takes every query row of one KV head: the
#   R = H / n_kv query heads times T queries, as a [BLOCK_M, D] block (row i = r * T + t,
#   padded to a power of two >= 16 for tl.dot; padded rows see no key). Chunks c < n_chunks
#   cover history tokens [c * chunk, (c + 1) * chunk); the last chunk is the fp region.
# - History tiles of BLOCK_N tokens are dequantized in registers: the packed bytes
#   [BLOCK_N, D/2] are split into nibbles and interleaved back into channel order. BLOCK_N
#   divides G and the chunk is a multiple of BLOCK_N, so a tile lies inside one key group and
#   needs one [D] scale/zero row; values need their [D/G] per-token metadata.
# - Online softmax in base 2 (q pre-scaled by D**-0.5 * log2(e)), fp32 throughout. The dots
#   run in tf32 on GPUs (fp32 ieee dots would make the decode kernel compute-bound) and in
#   fp32 in the interpreter, which ignores input_precision.
# - Each program writes its unnormalized partial (acc [BLOCK_M, D], m, l [BLOCK_M]) to fp32
#   scratch; `_merge_kernel` combines the chunks by log-sum-exp and writes q's dtype.


@triton.jit
def _unpack_nibbles(byte):
    """uint8 [N, D/2] -> fp32 [N, D] in channel order (element 2i low nibble, 2i + 1 high)."""
    return tl.interleave(byte & 0xF, byte >> 4).to(tl.float32)


@triton.jit
def _online_update(
    q, k, v, visible, acc, m_i, l_i, cap, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr
):
    """One key tile of the online softmax. q [BM, D] (pre-scaled, base 2), k/v [BN, D] fp32,
    visible [BM, BN]; acc [BM, D], m_i/l_i [BM]. SOFTCAP: scores s -> cap tanh(s / cap), with
    `cap` the soft cap times log2(e) (the scores' base-2 units)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN]
    if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): exp's overflow gives 1, its underflow -1
        scores = cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # stays _NO_SCORE while a row sees nothing
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [BM, BN], 0 where hidden
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _dequant_planes(upper_ptr, lower_ptr, plane_off, key_ok, scale, zero, INT8: tl.constexpr):
    """A tile's codes at plane_off [BN, D/2] as fp32 [BN, D] times scale plus zero (each
    broadcast to [BN, D]): the INT4 view from the upper plane, the INT8 view from both."""
    upper = _unpack_nibbles(tl.load(upper_ptr + plane_off, mask=key_ok[:, None], other=0))
    if INT8:
        lower = _unpack_nibbles(tl.load(lower_ptr + plane_off, mask=key_ok[:, None], other=0))
        return (16.0 * upper + (lower - _LOWER_OFFSET)) * (scale / 16.0) + zero
    return upper * scale + zero


@triton.jit
def _dequant_key_tile(
    upper_ptr, lower_ptr, scale_ptr, zero_ptr, plane_off, meta_off, key_ok, INT8: tl.constexpr
):
    """Keys of one tile as fp32 [BN, D]: plane_off [BN, D/2] byte offsets, meta_off [D] the
    offsets of the tile's group row in k_scale/k_zero (per channel)."""
    scale = tl.load(scale_ptr + meta_off)[None, :]  # [1, D]
    zero = tl.load(zero_ptr + meta_off)[None, :]
    return _dequant_planes(upper_ptr, lower_ptr, plane_off, key_ok, scale, zero, INT8)


@triton.jit
def _dequant_value_tile(
    upper_ptr, lower_ptr, scale_ptr, zero_ptr, plane_off, meta_off, key_ok,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    """Values of one tile as fp32 [BN, D]: meta_off [BN] offsets of each token's metadata row
    ([D/G] per token). With G = D the row is one number, broadcast along channels; otherwise
    each channel reads its group's entry (D/G distinct values per token)."""
    if HEAD_DIM == GROUP_SIZE:
        scale = tl.load(scale_ptr + meta_off, mask=key_ok, other=0.0)[:, None]  # [BN, 1]
        zero = tl.load(zero_ptr + meta_off, mask=key_ok, other=0.0)[:, None]
    else:
        group = (tl.arange(0, HEAD_DIM) // GROUP_SIZE)[None, :]  # [1, D]
        scale = tl.load(scale_ptr + meta_off[:, None] + group, mask=key_ok[:, None], other=0.0)
        zero = tl.load(zero_ptr + meta_off[:, None] + group, mask=key_ok[:, None], other=0.0)
    return _dequant_planes(upper_ptr, lower_ptr, plane_off, key_ok, scale, zero, INT8)


@triton.jit
def _hier_partial_kernel(
    q_ptr,  # [B, H, T, D]
    k_upper_ptr, k_lower_ptr, v_upper_ptr, v_lower_ptr,  # [B, n_kv, S, D/2] uint8
    k_scale_ptr, k_zero_ptr,  # [B, n_kv, S/G, D] fp32
    v_scale_ptr, v_zero_ptr,  # [B, n_kv, S, D/G] fp32
    fp_k_ptr, fp_v_ptr,  # [B, n_kv, F, D]
    index_ptr,  # [3, T] int32: n_quant_q, input_pos, fp_lo
    acc_ptr,  # [B * n_kv, n_chunks + 1, BLOCK_M, D] fp32
    m_ptr, l_ptr,  # [B * n_kv, n_chunks + 1, BLOCK_M] fp32
    n_kv, T, n_hist, n_fp, fp_pos0, n_hist_chunks, chunk, qk_scale, cap, window,
    stride_qb, stride_qh, stride_qt,
    stride_pb, stride_ph, stride_ps,
    stride_kmb, stride_kmh, stride_kmg,
    stride_vmb, stride_vmh, stride_vms,
    stride_fb, stride_fh, stride_fs,
    R: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, INT8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = (pid_bh // n_kv).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31
    h = (pid_bh % n_kv).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)  # row i = r * T + t
    t = rows % T
    row_ok = rows < R * T
    head = h * R + rows // T
    d = tl.arange(0, HEAD_DIM)
    q_off = b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale

    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), _NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    offs_tile = tl.arange(0, BLOCK_N)
    if pid_c < n_hist_chunks:
        # quantized history: tokens [start, end) of this chunk
        n_visible = tl.load(index_ptr + t, mask=row_ok, other=0)  # [BM] n_quant_q per row
        oldest = tl.load(index_ptr + T + t, mask=row_ok, other=0) - window  # [BM] (exclusive)
        start = pid_c * chunk  # chunk is a runtime value: one compile serves every length
        end = tl.minimum(start + chunk, n_hist)
        bytes_ = tl.arange(0, HEAD_DIM // 2)
        plane_base = b * stride_pb + h * stride_ph
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + offs_tile  # [BN] token positions
            key_ok = offs_n < end
            plane_off = plane_base + offs_n[:, None] * stride_ps + bytes_[None, :]  # [BN, D/2]
            k_meta = b * stride_kmb + h * stride_kmh + (n0 // GROUP_SIZE) * stride_kmg + d
            v_meta = b * stride_vmb + h * stride_vmh + offs_n * stride_vms  # [BN]
            k = _dequant_key_tile(
                k_upper_ptr, k_lower_ptr, k_scale_ptr, k_zero_ptr, plane_off, k_meta, key_ok, INT8
            )
            v = _dequant_value_tile(
                v_upper_ptr, v_lower_ptr, v_scale_ptr, v_zero_ptr, plane_off, v_meta, key_ok,
                HEAD_DIM, GROUP_SIZE, INT8,
            )  # fmt: skip
            visible = key_ok[None, :] & (offs_n[None, :] < n_visible[:, None])  # [BM, BN]
            visible &= offs_n[None, :] > oldest[:, None]  # (a local layer's window)
            acc, m_i, l_i = _online_update(
                q, k, v, visible, acc, m_i, l_i, cap, DOT_PRECISION, SOFTCAP
            )
    else:
        # the full-precision region, keys j = 0 .. F-1 at positions fp_pos0 + j
        pos = tl.load(index_ptr + T + t, mask=row_ok, other=0)  # [BM]
        lo = tl.load(index_ptr + 2 * T + t, mask=row_ok, other=0)
        fp_base = b * stride_fb + h * stride_fh
        for n0 in range(0, n_fp, BLOCK_N):
            offs_n = n0 + offs_tile
            key_ok = offs_n < n_fp
            fp_off = fp_base + offs_n[:, None] * stride_fs + d[None, :]  # [BN, D]
            k = tl.load(fp_k_ptr + fp_off, mask=key_ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(fp_v_ptr + fp_off, mask=key_ok[:, None], other=0.0).to(tl.float32)
            visible = (
                row_ok[:, None]
                & key_ok[None, :]
                & (offs_n[None, :] >= lo[:, None])
                & (fp_pos0 + offs_n[None, :] <= pos[:, None])
                & (fp_pos0 + offs_n[None, :] > pos[:, None] - window)
            )
            acc, m_i, l_i = _online_update(
                q, k, v, visible, acc, m_i, l_i, cap, DOT_PRECISION, SOFTCAP
            )

    part = pid_bh * (n_hist_chunks + 1) + pid_c
    tl.store(acc_ptr + (part * BLOCK_M + rows)[:, None] * HEAD_DIM + d[None, :], acc)
    tl.store(m_ptr + part * BLOCK_M + rows, m_i)
    tl.store(l_ptr + part * BLOCK_M + rows, l_i)


@triton.jit
def _merge_kernel(
    acc_ptr, m_ptr, l_ptr,  # partials, as written by _hier_partial_kernel
    out_ptr,  # [B, H, T, D], q's dtype
    n_kv, T, n_parts,
    stride_ob, stride_oh, stride_ot,
    R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Log-sum-exp merge of the n_parts partials of one KV head's query rows."""
    pid_bh = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    m_run = tl.full((BLOCK_M,), _NO_SCORE, dtype=tl.float32)
    l_run = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_run = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for c in range(0, n_parts):
        part = (pid_bh * n_parts + c) * BLOCK_M + rows  # [BM]
        m_c = tl.load(m_ptr + part)
        m_new = tl.maximum(m_run, m_c)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_c - m_new)
        acc_c = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :])
        acc_run = acc_run * alpha[:, None] + acc_c * beta[:, None]
        l_run = l_run * alpha + tl.load(l_ptr + part) * beta
        m_run = m_new
    seen = l_run > 0  # a row that saw no key (l = 0, acc = 0) comes out as zeros, not NaN
    out = acc_run / tl.where(seen, l_run, 1.0)[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16_grid(out)

    b = pid_bh // n_kv
    head = (pid_bh % n_kv) * R + rows // T
    out_off = b * stride_ob + head[:, None] * stride_oh + (rows % T)[:, None] * stride_ot
    row_ok = rows < R * T
    tl.store(out_ptr + out_off + d[None, :], out.to(out_ptr.dtype.element_ty), row_ok[:, None])


INTERPRETED = interpreted(_hier_partial_kernel)  # (`kernels.triton.runs.kernel_runs_on`)


# ---------------------------------------------------------------------------------------------
# Launch config and launch


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_config(head_dim: int, group_size: int, on_cuda: bool) -> dict:
    """Fixed tiles (no autotune: multi-config autotune fails in the interpreter). BLOCK_N
    divides G. On CUDA 64-token tiles keep the fp32 K/V tiles in registers; the interpreter
    pays per operation, so it gets the largest tile."""
    if on_cuda:
        return {"BLOCK_N": min(group_size, 64), "num_warps": 4 if head_dim <= 64 else 8}
    return {"BLOCK_N": min(group_size, 128), "num_warps": 4}


def _chunk_tokens(chunk_size, n_hist: int, n_bh: int, block_n: int, device) -> int:
    """History tokens per program, a multiple of BLOCK_N. Default on CUDA: enough chunks for
    about two programs per SM; in the interpreter, the whole history in one chunk."""
    if chunk_size is None:
        if device.type != "cuda":
            chunk_size = max(n_hist, block_n)
        else:
            wanted = max(1, -(-2 * _sm_count(device.index or 0) // n_bh))
            chunk_size = max(-(-n_hist // wanted), 2 * block_n)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return -(-chunk_size // block_n) * block_n


def _row_major(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors of one shape with unit last stride and one shared set of strides (the kernel
    takes one stride triple per group); copies only when that does not already hold."""
    if all(t.stride() == tensors[0].stride() and t.stride(-1) == 1 for t in tensors):
        return tensors
    return tuple(t.contiguous() for t in tensors)


def launcher(
    q: torch.Tensor,
    view: HierLayerView,
    rows: QueryRows,
    kv: str,
    chunk_size: int | None,
    dot_precision: str | None,
    softcap: float | None,
):
    """`kernels.triton.hier_attention.hier_attention_launcher` after its checks: the host work
    of one call, and `run() -> out`, which launches the two kernels."""
    B, H, T, D = q.shape
    G, n_kv = view.group_size, view.k_upper.shape[1]
    R = H // n_kv
    out = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return lambda: out
    index = rows.index(T)  # [3, T] on the CPU
    n_hist = int(index[0].max())
    if n_hist > view.k_upper.shape[2]:
        raise ValueError(f"n_quant_q reaches {n_hist}, beyond the planes' {view.k_upper.shape[2]}")
    index = index.to(device=q.device, dtype=torch.int32)  # one upload, no device sync

    config = _launch_config(D, G, q.is_cuda)
    block_n = config.pop("BLOCK_N")
    chunk = _chunk_tokens(chunk_size, n_hist, B * n_kv, block_n, q.device)
    n_chunks = -(-n_hist // chunk)
    block_m = max(16, triton.next_power_of_2(R * T))
    parts = n_chunks + 1
    acc = torch.empty((B * n_kv, parts, block_m, D), dtype=torch.float32, device=q.device)
    m = torch.empty((B * n_kv, parts, block_m), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)

    planes = _row_major(view.k_upper, view.k_lower, view.v_upper, view.v_lower)
    k_meta = _row_major(view.k_scale, view.k_zero)
    v_meta = _row_major(view.v_scale, view.v_zero)
    fp = _row_major(view.fp_k, view.fp_v)
    q = q if q.stride(-1) == 1 else q.contiguous()
    precision = dot_precision or ("tf32" if q.is_cuda else "ieee")
    partial_args = (
        q, *planes, *k_meta, *v_meta, *fp, index, acc, m, l,
        n_kv, T, n_hist, view.fp_k.shape[2], int(view.fp_pos0), n_chunks, chunk, D**-0.5 * _LOG2E,
        (softcap or 1.0) * _LOG2E, rows.window or NO_WINDOW,
        *q.stride()[:3], *planes[0].stride()[:3], *k_meta[0].stride()[:3],
        *v_meta[0].stride()[:3], *fp[0].stride()[:3],
    )  # fmt: skip
    partial_meta = dict(
        R=R, HEAD_DIM=D, GROUP_SIZE=G, BLOCK_M=block_m, BLOCK_N=block_n,
        INT8=kv == "int8", DOT_PRECISION=precision, SOFTCAP=bool(softcap), **config,
    )  # fmt: skip
    merge_args = (acc, m, l, out, n_kv, T, parts, *out.stride()[:3])

    def run() -> torch.Tensor:
        _hier_partial_kernel[(B * n_kv, parts)](*partial_args, **partial_meta)
        _merge_kernel[(B * n_kv,)](*merge_args, R=R, HEAD_DIM=D, BLOCK_M=block_m, num_warps=4)
        return out

    return run
