"""The CPU fast path of the hierarchical-KV attention: `hier_attention.cpp`, over one layer
view (a cache of one layer for the caches' `HierKV`, `kv_cache.py`).

Same arguments (q, view, rows, kv, chunk_size) as the Triton kernel
(`kernels/triton/hier_attention.py`) and their PyTorch twin `kernels.reference.
hier_attention_ref`, which the tests compare it against. Built by `kernels.cpu.build` on first
use; when it cannot be built, `available()` is False and `kernels.attention.hier_attention`
takes another path.
"""

from __future__ import annotations

import os

import torch

from kernels.cpu import build as cpu_ext
from kernels.cpu import kv_cache as cpu_kv
from kernels.planes import HierLayerView, QueryRows, check_view
from kernels.reference import causal_attention as causal_attention_ref
from kernels.reference import causal_visible, soft_cap

DEFAULT_CHUNK = 512  # history tokens per task (the threads split the history in chunks)


def available() -> bool:
    return cpu_ext.available()


def _fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """The cache's full-precision slice as the kernel reads it: in place when it is already
    fp32 with unit last stride (strided rows are fine), else an fp32 copy."""
    return x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()


def hier_attention_cpu(
    q: torch.Tensor,
    view: HierLayerView,
    rows: QueryRows,
    kv: str,
    chunk_size: int | None = None,
    int_queries: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over one layer of the hierarchical cache in the KV view `kv` ("int8" or
    "int4"), the history scored with int16 queries and integer dots when `int_queries`, the
    scores soft-capped by `softcap` (Gemma 2) where given;
    returns [B, H, T, D] in q's dtype (a view of a [B, T, H, D] buffer: the output
    projection's transpose(1, 2).reshape is then free). No shape checks beyond the C++ ones:
    this is the per-layer hot path."""
    check_view(kv)
    if cpu_ext.load() is None:
        raise RuntimeError(f"CPU attention kernel unavailable: {cpu_ext.failure()}")
    # one layer as a cache of one: [1, ...] views of the view's tensors (no copies but a
    # region not fp32 with unit last stride), the region's F positions all valid
    names = cpu_kv.HIER_BUFFERS
    layer = {n: t.unsqueeze(0) for n, t in zip(names, view_tensors(view), strict=True)}
    chunk = int(chunk_size or DEFAULT_CHUNK)
    cache = cpu_kv.hier_kv(layer, int(view.group_size), chunk, (rows.window,))
    step = cpu_kv.hier_step(
        lo=0,
        n_fp=int(view.fp_k.shape[2]),
        n_quant=int(view.fp_pos0),
        n_quant_q=torch.as_tensor(rows.n_quant_q),
        shift=torch.as_tensor(rows.fp_lo),
        input_pos=torch.as_tensor(rows.input_pos),
        int8=kv == "int8",  # both planes; else the upper plane only
        int_queries=bool(int_queries),
        softcap=float(softcap or 0.0),
        parents=None if rows.parents is None else torch.as_tensor(rows.parents),
    )
    return cache.attend(0, q, step).to(q.dtype)


def view_tensors(view: HierLayerView) -> tuple[torch.Tensor, ...]:
    """A layer view's tensors in `kv_cache.HIER_BUFFERS` order, the region as the kernel
    reads it (`_fp32_rows`)."""
    return (
        view.k_upper,
        view.k_lower,
        view.k_scale,
        view.k_zero,
        view.v_upper,
        view.v_lower,
        view.v_scale,
        view.v_zero,
        _fp32_rows(view.fp_k),
        _fp32_rows(view.fp_v),
    )


# ------------------------------------------------------------ a prefill chunk (flash_prefill)
PREFILL_MIN_ROWS = 18  # longer than any decode or verify step: those keep their own kernels
PREFILL_HEAD_DIMS = (64, 80, 96, 128, 256)  # `flash::supported`


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes q [B, H, T, D] over k/v [B, n_kv, S, D]."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and q.shape[2] >= PREFILL_MIN_ROWS
        and q.shape[-1] in PREFILL_HEAD_DIMS
        and q.shape[1] % k.shape[1] == 0
        and k.stride() == v.stride()
        and k.stride(-1) == 1
        and k.stride(-2) == k.shape[-1]
        and cpu_ext.available()
    )


PRODUCTS_ENV = "QSPEC_PREFILL_PRODUCTS"  # the prefill attention's products (PRODUCTS)
PRODUCTS = ("fp32", "sdpa", "bf16", "bf16-values", "int16")
# torch's own path for the fp32 numbers: `kernels.reference.causal_attention`, SDPA with a
# causal mask. A candidate of every build, so a CPU whose tiled kernel is slow (one nobody here
# has measured) prefills at torch's speed at worst.
TORCH_PRODUCTS = "sdpa"


def built_products() -> tuple[str, ...]:
    """The products this build computes: "fp32" and "sdpa" always, "bf16" and "bf16-values"
    with AVX512-BF16, "int16" on x86 builds with AVX2 (none without the C++ kernels)."""
    if not cpu_ext.available():  # (QSPEC_CPU_KERNELS=0, or a failed build)
        return ()
    ext = cpu_ext.load()
    bf16 = ("bf16", "bf16-values") if ext.PREFILL_BF16 else ()
    return ("fp32", TORCH_PRODUCTS, *bf16, *(("int16",) if ext.PREFILL_INT16 else ()))


def asked_products() -> str | None:
    """What QSPEC_PREFILL_PRODUCTS asks for, None when unset or "auto"; a BuildSettingError
    for a name not in PRODUCTS."""
    asked = os.environ.get(PRODUCTS_ENV, "").strip().lower()
    if asked in ("", "auto"):
        return None
    if asked not in PRODUCTS:
        raise cpu_ext.BuildSettingError(
            f"{PRODUCTS_ENV} is auto or one of {', '.join(map(repr, PRODUCTS))}, not {asked!r}"
        )
    return asked


def prefill_products(asked: str | None = None) -> str:
    """The products of the prefill attention (`flash_prefill.h`, `flash_bf16.h`,
    `flash_int16.h`): "fp32"; "sdpa", the fp32 numbers on torch's SDPA; "bf16", every operand
    rounded to bf16 (queries, keys, probabilities, values); "bf16-values", fp32 scores and bf16
    value sums (probabilities and values rounded); or "int16", every operand rounded to 12- or
    14-bit integer codes with a step per row, channel or block. `asked` (else
    QSPEC_PREFILL_PRODUCTS, else "fp32") where this build has it (`built_products`), else
    "fp32". The QuantSpec prefill asks for the products measured fastest on this machine
    (`qspec_core/runner/products_choice.py`)."""
    asked = asked or asked_products() or "fp32"
    if asked not in PRODUCTS:
        raise cpu_ext.BuildSettingError(f"no prefill attention products {asked!r}")
    return asked if asked in built_products() else "fp32"


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    products: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
):
    """Causal attention of queries at positions start .. start + T - 1 (q [B, H, T, D]) over
    keys 0 .. start + T - 1 (k/v [B, n_kv, S, D], S >= start + T, GQA by head groups), under a
    sliding `window` only the last `window` of them, the scaled scores capped by `softcap`
    (Gemma 2) where given: tiled in C++ (`flash_prefill.h`), no [T, S] scores in memory;
    fp32 -> [B, H, T, D]. Equals `kernels.reference.
    causal_attention` (SDPA) to rounding, its twin in the tests (with other products,
    `prefill_products(products)`, to the rounding of the operands)."""
    chosen = prefill_products(products)
    if chosen == TORCH_PRODUCTS:
        S = start + q.shape[2]
        positions = torch.arange(start, S, device=q.device)
        keys, values = k[:, :, :S], v[:, :, :S]
        return causal_attention_ref(q, keys, values, positions, softcap=softcap, window=window)
    ext = cpu_ext.load()
    cap = float(softcap or 0.0)
    return ext.prefill_attention_cpu(q, k, v, start, chosen, window or 0, cap)


def prefill_attention_bf16_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scores_bf16: bool = True,
    window: int | None = None,
    softcap: float | None = None,
):
    """The bf16 products' twin (`flash_bf16.h`): q / sqrt(D) and k rounded to bf16 (unless
    not `scores_bf16`: "bf16-values"), v and the probabilities rounded to bf16, the products
    summed in fp32, the softmax folded over blocks of 64 keys in order as the kernel folds them
    (each block's probabilities taken against the running max, then rounded). It differs from
    the kernel by fp32 summation order and its exp polynomial, which may move a probability's
    bf16 rounding by one step. q [B, H, T, D] at positions start.. over k/v [B, n_kv, S, D]
    (under a sliding `window`, its last `window` keys; the scores capped by `softcap`)."""
    B, H, T, D = q.shape
    S, group = start + T, H // k.shape[1]
    scale = 1 / torch.tensor(float(D)).sqrt()  # (1.f / sqrt(float(D)), as the kernel has it)
    qs = q.float() * scale
    keys = k[:, :, :S].repeat_interleave(group, 1).float()
    if scores_bf16:
        qs, keys = qs.bfloat16().float(), keys.bfloat16().float()
    values = v[:, :, :S].repeat_interleave(group, 1).bfloat16().float()
    scores = qs @ keys.transpose(-1, -2)  # [B, H, T, S]

    def value_sums(p: torch.Tensor, k0: int) -> torch.Tensor:
        return p.bfloat16().float() @ values[:, :, k0 : k0 + p.shape[-1]]

    return _block_folds(scores, start, D, value_sums, window, softcap)


FOLD_BLOCK = 64  # keys a fold takes where no kernel is built (flash_prefill.h's KB on AVX-512)


def fold_block() -> int:
    """The keys a fold takes in the twins: the built kernel's KB (64 with AVX-512, 32 on 8-lane
    builds: the int16 probabilities' steps are per block), FOLD_BLOCK without a build."""
    return int(cpu_ext.load().PREFILL_KEY_BLOCK) if cpu_ext.available() else FOLD_BLOCK


def _block_folds(
    scores: torch.Tensor,
    start: int,
    D: int,
    value_sums,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The kernel's online softmax, as its twins compute it: scores [B, H, T, S] of queries at
    positions start.. (capped by `softcap` where given, then masked here past each one's
    position and, under a sliding `window`, below its window), folded over blocks of
    `fold_block()` keys in order, each block's probabilities p [B, H, T, <= that] taken
    against the running max and summed with the block's values by `value_sums(p, k0)` ->
    [B, H, T, D]; the sums over the probabilities' total. A block before any key a row sees
    leaves that row as it was (the kernel's)."""
    B, H, T, S = scores.shape
    visible = causal_visible(torch.arange(start, S), S, window)
    scores = soft_cap(scores, softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = torch.full((B, H, T, 1), float("-inf"))
    acc, total = torch.zeros(B, H, T, D), torch.zeros(B, H, T, 1)
    block = fold_block()
    for k0 in range(0, S, block):
        s_b = scores[..., k0 : k0 + block]
        new_m = torch.maximum(m, s_b.amax(-1, keepdim=True))
        unseen = new_m == float("-inf")  # (no key of the row yet: exp(-inf - -inf) is NaN)
        alpha = torch.where(unseen, 1.0, (m - new_m).exp())
        p = torch.where(unseen, 0.0, (s_b - new_m).exp())
        total = total * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + value_sums(p, k0)
        m = new_m
    return acc / total


def prefill_attention_int16_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None = None,
    softcap: float | None = None,
):
    """The int16 products' twin (`flash_int16.h`): keys and values rounded per channel over
    their S = start + T rows to codes of step max|x| / 8191 (keys of heads wider than 64:
    / 4095, wider than 128: / 2047); q / sqrt(D) times the keys' steps rounded per row to
    step max / 4095; the scores the exact integer dots times the row's step; the softmax
    folded over blocks of `fold_block()` keys in order as the kernel folds them, each block's
    probabilities rounded per row to step 2^(e - 11), 2^e <= their max (below 2^-115: codes
    0), and summed with the value codes exactly; the values' steps applied at the end. It
    differs from the kernel by fp32 summation order and its exp polynomial, which may move a
    probability's code by one.
    q [B, H, T, D] at positions start.. over k/v [B, n_kv, S, D] (under a sliding `window`,
    its last `window` keys; the steps are still over all S rows; the scores capped by
    `softcap`, after their steps)."""
    B, H, T, D = q.shape
    S, group = start + T, H // k.shape[1]

    def rounded(x: torch.Tensor, dim: int, levels: float):
        amax = x.abs().amax(dim, keepdim=True)  # (NaN where x has one)
        ok = amax.isfinite() & (amax >= 1e-30)  # (isa.h's kMinAmax: below it, codes 0, step 0)
        step = torch.where(ok, amax / levels, torch.zeros_like(amax))
        step = torch.where(amax.isfinite(), step, float("nan"))  # (a NaN reaches the output)
        inv = torch.where(ok, levels / amax, torch.zeros_like(amax))
        return (x * inv).nan_to_num(0.0).round().clamp(-levels, levels), step

    key_levels = 8191.0 if D <= 64 else 4095.0 if D <= 128 else 2047.0
    key_codes, key_step = rounded(k[:, :, :S].float(), 2, key_levels)  # step [B, n_kv, 1, D]
    value_codes, value_step = rounded(v[:, :, :S].float(), 2, 8191.0)
    key_codes = key_codes.repeat_interleave(group, 1).double()
    value_codes = value_codes.repeat_interleave(group, 1).double()
    value_step = value_step.repeat_interleave(group, 1)
    scale = 1 / torch.tensor(float(D)).sqrt()  # (1.f / sqrt(float(D)), as the kernel has it)
    q_codes, q_step = rounded(q.float() * scale * key_step.repeat_interleave(group, 1), 3, 4095.0)
    scores = (q_codes.double() @ key_codes.transpose(-1, -2)).float() * q_step  # [B, H, T, S]

    def value_sums(p: torch.Tensor, k0: int) -> torch.Tensor:
        top = p.amax(-1, keepdim=True)
        e = torch.frexp(top).exponent - 1  # 2^e <= top < 2^(e + 1)
        p_step = torch.where(e > -116, torch.ldexp(torch.ones_like(top), e - 11), 0.0)
        inv = torch.where(e > -116, torch.ldexp(torch.ones_like(top), 11 - e), 0.0)
        p_codes = (p * inv).round().clamp(0, 4096)
        block = value_codes[:, :, k0 : k0 + p.shape[-1]]
        return (p_codes.double() @ block).float() * p_step

    return _block_folds(scores, start, D, value_sums, window, softcap) * value_step
