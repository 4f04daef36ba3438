"""The tiled causal attention of a prefill chunk (`kernels/cpu/flash_prefill.h`) against its
twin, the reference's SDPA (`kernels.reference.causal_attention`), and its own promises: rows
independent of the chunk they come in and of the heads that share their unit, GQA head groups,
strided cache rows, the dispatch."""

from __future__ import annotations

import pytest
import torch

from kernels import attention as dispatch
from kernels.cpu import attention as cpu_attention
from kernels.cpu import build
from kernels.reference import causal_attention, causal_visible

pytestmark = pytest.mark.skipif(not build.available(), reason="the CPU kernels are not built here")


def _qkv(B, H, n_kv, T, S, D, seed, room=7):
    """q [B, H, T, D]; k/v [B, n_kv, S, D] sliced from a longer buffer (the cache's layout:
    rows contiguous per head, head stride larger than S D)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, n_kv, S + room, D, generator=g)[:, :, :S]
    v = torch.randn(B, n_kv, S + room, D, generator=g)[:, :, :S]
    return q, k, v


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(("H", "n_kv"), [(9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize(("start", "T"), [(0, 18), (0, 100), (5, 33), (64, 64), (200, 130)])
def test_matches_sdpa(D, H, n_kv, start, T):
    q, k, v = _qkv(2, H, n_kv, T, start + T, D, seed=D + H + start + T)
    got = cpu_attention.prefill_attention(q, k, v, start)
    want = causal_attention(q, k, v, torch.arange(start, start + T))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


bf16 = pytest.mark.skipif(
    not build.available() or not build.load().PREFILL_BF16, reason="no AVX512-BF16 build here"
)


@bf16
@pytest.mark.parametrize("products", ["bf16", "bf16-values"])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(
    ("H", "n_kv", "start", "T"), [(9, 3, 0, 45), (6, 1, 70, 33), (4, 2, 5, 130)]
)
def test_bf16_products_match_their_twin_and_sdpa_to_bf16_rounding(
    products, D, H, n_kv, start, T, monkeypatch
):
    """QSPEC_PREFILL_PRODUCTS=bf16 (or bf16-values): the kernel equals its twin (the same
    operands rounded to bf16, fp32 sums, the same block folds) but for a rare bf16 step of a
    probability, and SDPA to bf16 rounding, odd key counts and partial key blocks included;
    rows stay independent of their chunk."""
    q, k, v = _qkv(1, H, n_kv, T, start + T, D, seed=D * 5 + H + T)
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, products)
    assert cpu_attention.prefill_products() == products
    got = cpu_attention.prefill_attention(q, k, v, start)
    twin = cpu_attention.prefill_attention_bf16_ref(q, k, v, start, scores_bf16=products == "bf16")
    torch.testing.assert_close(got, twin, rtol=1e-3, atol=2e-3)  # (a bf16 step: 2^-8)
    assert (got - twin).abs().mean() < 2e-5  # (almost every value to fp32 summation order)
    exact = causal_attention(q, k, v, torch.arange(start, start + T))
    err = (got - exact).abs().max().item()
    assert 1e-5 < err < 3e-2  # (bf16 rounding is real, and bounded)
    tail = cpu_attention.prefill_attention(q[:, :, 20:], k, v, start + 20)
    assert torch.equal(got[:, :, 20:], tail)


int16 = pytest.mark.skipif(
    not build.available() or not build.load().PREFILL_INT16,
    reason="no int16 products in this build (x86 with AVX2)",
)


@int16
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(
    ("H", "n_kv", "start", "T"), [(9, 3, 0, 45), (6, 1, 70, 33), (4, 2, 5, 130), (14, 2, 600, 237)]
)
def test_int16_products_match_their_twin_and_sdpa_closer_than_bf16(
    D, H, n_kv, start, T, monkeypatch
):
    """QSPEC_PREFILL_PRODUCTS=int16: the kernel equals its twin (the same codes and steps,
    exact integer sums, the same block folds) but for a rare one-code step of a probability,
    and SDPA to its rounding, which is real and several times smaller than bf16's; odd key
    counts, partial key blocks, a channel 30 times the others (its step folds into the
    queries) and GQA groups of 1 to 7 included; rows stay independent of their chunk."""
    q, k, v = _qkv(1, H, n_kv, T, start + T, D, seed=D * 7 + H + T)
    k[..., 3] *= 30
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, "int16")
    assert cpu_attention.prefill_products() == "int16"
    got = cpu_attention.prefill_attention(q, k, v, start)
    twin = cpu_attention.prefill_attention_int16_ref(q, k, v, start)
    torch.testing.assert_close(got, twin, rtol=1e-4, atol=2e-3)  # (a code step of a p: 2^-11)
    assert (got - twin).abs().mean() < 2e-6
    exact = causal_attention(q, k, v, torch.arange(start, start + T))
    err = (got - exact).norm() / exact.norm()
    bf16_err = (
        cpu_attention.prefill_attention_bf16_ref(q, k, v, start) - exact
    ).norm() / exact.norm()
    assert 1e-6 < err < bf16_err / 2, (err, bf16_err)
    tail = cpu_attention.prefill_attention(q[:, :, 20:], k, v, start + 20)
    assert torch.equal(got[:, :, 20:], tail)


@int16
@pytest.mark.parametrize("D", [64, 128, 256])
def test_int16_sums_do_not_overflow_at_the_largest_codes(D, monkeypatch):
    """Codes near their bounds, all of one sign: queries and keys of one sign and nearly one
    magnitude (a score's D products near 4095 x 8191, 4095 x 4095 at D = 128, 4095 x 2047 at
    D = 256), values all 1 and near-equal scores (a block's probability codes near 4096, value
    codes 8191): the int32 sums come within 10% of 2^31, where a wrapped sum would be
    negative, and the output is the plain mean, 1 (and -1 in a channel of -1)."""
    q = torch.full((1, 4, 64, D), 0.01)
    k = torch.full((1, 2, 512, D), 0.01)
    k[:, :, :, 0] += torch.linspace(1e-3, 0, 512)  # (scores fall: p just under 1 after block 0)
    v = torch.ones(1, 2, 512, D)
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, "int16")
    got = cpu_attention.prefill_attention(q, k, v, 448)
    torch.testing.assert_close(got, torch.ones_like(got), rtol=0, atol=1e-3)
    v[:, :, :, 1] = -1.0  # (the negative bound too)
    got = cpu_attention.prefill_attention(q, k, v, 448)
    torch.testing.assert_close(got[..., 1], -torch.ones_like(got[..., 1]), rtol=0, atol=1e-3)


@int16
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int16_products_carry_a_nan_or_an_infinity_to_the_output(bad, monkeypatch):
    """A NaN or an infinity in a key, a value or a query becomes NaN in the output, as with the
    fp32 products, never a finite-looking result (a NaN converts to the integer INT_MIN, which
    a clamp would make a code like any other)."""
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, "int16")
    for which in ("q", "k", "v"):
        q, k, v = _qkv(1, 4, 2, 40, 100, 64, seed=9)
        {"q": q, "k": k, "v": v}[which][0, 0, 30, 5] = bad
        got = cpu_attention.prefill_attention(q, k, v, 60)
        exact = causal_attention(q, k, v, torch.arange(60, 100))
        assert torch.isnan(got).any(), which
        assert torch.isnan(got[~torch.isfinite(exact)]).all(), which  # (where fp32 has one)


def test_products_default_to_fp32_and_refuse_unknown_types(monkeypatch):
    monkeypatch.delenv(cpu_attention.PRODUCTS_ENV, raising=False)
    assert cpu_attention.prefill_products() == "fp32"
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, "fp16")
    with pytest.raises(ValueError, match="'fp32', 'sdpa', 'bf16', 'bf16-values'"):
        cpu_attention.prefill_products()


def test_a_row_does_not_depend_on_its_chunk():
    """Each query row is computed alone (its own dots, softmax fold and value sums in key
    order): the same position over the same keys gives the same bits whether it comes first,
    last or in the middle of a chunk, whatever the chunk's length and the thread count."""
    q, k, v = _qkv(1, 9, 3, 300, 300, 64, seed=3)
    whole = cpu_attention.prefill_attention(q, k, v, 0)
    tail = cpu_attention.prefill_attention(q[:, :, 137:], k, v, 137)
    assert torch.equal(whole[:, :, 137:], tail)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_attention.prefill_attention(q, k, v, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, alone)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_the_heads_beside_it(D, threads):
    """A unit takes several heads of one kv head, each through a span of key blocks before
    the next (they share the span while it is in cache), as many as leave the threads enough
    units: each head alone (a call of one head) gives the same bits as in its group. Qwen2.5's
    GQA, 7 heads a kv head: 237 rows are 8 blocks of rows, 16 units of 7 heads for 1 or 2
    threads, the last of 13 rows a head; with AVX-512 837 keys are one span of key blocks at D = 64
    (1,024 keys a span) and two at D = 128 (512), so both walks are checked."""
    q, k, v = _qkv(1, 14, 2, 237, 837, D, seed=6 + D)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        grouped = cpu_attention.prefill_attention(q, k, v, 600)
        for h in range(14):
            g = h // 7
            alone = cpu_attention.prefill_attention(
                q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], 600
            )
            assert torch.equal(grouped[:, h : h + 1], alone), h
    finally:
        torch.set_num_threads(before)
    want = causal_attention(q, k, v, torch.arange(600, 837))
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=2e-6)


def test_keys_past_a_row_are_invisible():
    """A key after a row's position changes nothing for that row (the mask has teeth: a
    kernel that let a row see its block's later keys would move)."""
    q, k, v = _qkv(1, 4, 2, 80, 80, 64, seed=4)
    before = cpu_attention.prefill_attention(q, k, v, 0)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] = 100.0
    v2[:, :, 50:] = -100.0
    after = cpu_attention.prefill_attention(q, k2, v2, 0)
    assert torch.equal(before[:, :, :50], after[:, :, :50])
    assert not torch.equal(before[:, :, 50:], after[:, :, 50:])


def test_dispatch_takes_the_kernel_for_a_prefill_chunk_only(monkeypatch):
    calls = []
    real = cpu_attention.prefill_attention
    monkeypatch.setattr(
        cpu_attention, "prefill_attention", lambda *a: calls.append(a[3]) or real(*a)
    )
    q, k, v = _qkv(1, 4, 2, 40, 60, 64, seed=5)
    out = dispatch.causal_attention(q, k, v, torch.arange(20, 60))
    assert calls == [20]
    torch.testing.assert_close(out, causal_attention(q, k, v, torch.arange(20, 60)))
    # a verify's rows, positions with a gap, bf16: the reference
    dispatch.causal_attention(q[:, :, :17], k, v, torch.arange(43, 60))
    gap = torch.cat([torch.arange(0, 20), torch.arange(40, 60)])
    dispatch.causal_attention(q, k, v, gap)
    dispatch.causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.arange(20, 60))
    assert calls == [20]


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("window", [1, 16, 33, 64, 200])
@pytest.mark.parametrize(("start", "T"), [(0, 130), (200, 100), (517, 64)])
def test_a_sliding_window_matches_sdpa(D, window, start, T):
    """A local layer's chunk (query at p sees keys p - window + 1 .. p): the kernel skips the
    blocks below its first row's window and masks the rest per row; equal to the reference's
    windowed SDPA to rounding, windows shorter than a block, a tile of rows, and longer."""
    q, k, v = _qkv(1, 6, 2, T, start + T, D, seed=D + window + start)
    got = cpu_attention.prefill_attention(q, k, v, start, window=window)
    want = causal_attention(q, k, v, torch.arange(start, start + T), window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_under_a_window_keys_below_it_are_invisible_and_rows_keep_their_bits():
    """Keys at or below a row's position - window change nothing for it, to the bit (a block
    the kernel folds wholly masked leaves the row as if skipped), and a row gives the same
    bits whatever chunk it comes in, though the blocks its tile skips differ."""
    q, k, v = _qkv(1, 4, 2, 200, 400, 64, seed=8)
    window, start = 50, 200
    whole = cpu_attention.prefill_attention(q, k, v, start, window=window)
    tail = cpu_attention.prefill_attention(q[:, :, 77:], k, v, start + 77, window=window)
    assert torch.equal(whole[:, :, 77:], tail)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, : start - window + 1] = 1e4  # (below the first row's window)
    v2[:, :, : start - window + 1] = -1e4
    assert torch.equal(whole, cpu_attention.prefill_attention(q, k2, v2, start, window=window))
    k2[:, :, 250] = 100.0  # (visible to rows at 250 .. 299 only)
    moved = cpu_attention.prefill_attention(q, k2, v2, start, window=window)
    changed = (moved != whole).any(-1).any(1)[0]  # [T]
    assert changed[50:100].all() and not changed[:50].any() and not changed[100:].any()


@int16
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", [20, 100])
def test_int16_products_under_a_window_match_their_twin(D, window, monkeypatch):
    q, k, v = _qkv(1, 6, 2, 130, 430, D, seed=D + window)
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, "int16")
    got = cpu_attention.prefill_attention(q, k, v, 300, window=window)
    twin = cpu_attention.prefill_attention_int16_ref(q, k, v, 300, window=window)
    torch.testing.assert_close(got, twin, rtol=1e-4, atol=2e-3)
    assert (got - twin).abs().mean() < 2e-6
    exact = causal_attention(q, k, v, torch.arange(300, 430), window=window)
    torch.testing.assert_close(got, exact, rtol=0, atol=3e-3)


def test_dispatch_hands_a_local_layers_window_and_a_soft_cap_to_the_kernel(monkeypatch):
    """A prefill chunk of a local layer runs the tiled kernel with its window (once the
    window hides a key; before that, as a global layer's), and Gemma 2's with its cap."""
    calls = []
    real = cpu_attention.prefill_attention
    monkeypatch.setattr(
        cpu_attention, "prefill_attention", lambda *a: calls.append(a[3:]) or real(*a)
    )
    q, k, v = _qkv(1, 4, 2, 40, 100, 64, seed=9)
    pos = torch.arange(60, 100)
    out = dispatch.causal_attention(q, k, v, pos, window=16)
    torch.testing.assert_close(out, causal_attention(q, k, v, pos, window=16))
    dispatch.causal_attention(q, k[:, :, :40], v[:, :, :40], torch.arange(40), window=64)
    capped = dispatch.causal_attention(q, k, v, pos, softcap=1.5, window=16)
    torch.testing.assert_close(capped, causal_attention(q, k, v, pos, softcap=1.5, window=16))
    assert calls == [(60, None, 16, None), (0, None, None, None), (60, None, 16, 1.5)]


def _spread_queries(q: torch.Tensor) -> torch.Tensor:
    """q with its rows scaled from 1/50 to 50 times: scores from far inside a cap's linear
    range (the tanh polynomial's) to far in its saturation (1 - e over 1 + e)."""
    T = q.shape[2]
    return q * torch.logspace(-1.7, 1.7, T).view(1, 1, T, 1)


def _float64_attention(q, k, v, start, cap, window):
    """The attention of q [B, H, T, D] at start.. in float64: scaled scores, the cap, the mask,
    the softmax (the truth both fp32 paths round away from)."""
    D, S = q.shape[3], start + q.shape[2]
    group = q.shape[1] // k.shape[1]
    keys = k[:, :, :S].double().repeat_interleave(group, 1)
    values = v[:, :, :S].double().repeat_interleave(group, 1)
    scores = q.double() @ keys.transpose(-1, -2) / D**0.5
    scores = torch.tanh(scores / cap) * cap
    visible = causal_visible(torch.arange(start, S), S, window)
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values).float()


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("cap", [0.7, 50.0])
@pytest.mark.parametrize(("start", "T", "window"), [(0, 100, None), (200, 130, 33)])
def test_a_soft_cap_matches_the_reference(D, cap, start, T, window):
    """Gemma 2's scores, cap tanh(s / cap) of the scaled scores before the mask, from scores a
    hundredth of the cap to a hundred times it (the tanh polynomial's range and the
    saturated one), with and without a window: the kernel is as close to the float64 truth as
    the reference's fp32 capped attention is (at a cap of 50 the scores reach 100, and both
    round them to about 1e-5 of the output), the cap changes the output, and a row's bits do
    not depend on its chunk."""
    q, k, v = _qkv(1, 6, 2, T, start + T, D, seed=D + start + int(cap))
    q = _spread_queries(q)
    pos = torch.arange(start, start + T)
    got = cpu_attention.prefill_attention(q, k, v, start, window=window, softcap=cap)
    want = causal_attention(q, k, v, pos, softcap=cap, window=window)
    truth = _float64_attention(q, k, v, start, cap, window)
    reference_error = (want - truth).abs().max().item()
    assert (got - truth).abs().max().item() <= 3 * reference_error + 1e-6
    uncapped = causal_attention(q, k, v, pos, window=window)
    assert (want - uncapped).abs().max() > 0.1  # (the cap bends these scores)
    tail = cpu_attention.prefill_attention(q[:, :, 40:], k, v, start + 40, None, window, cap)
    assert torch.equal(got[:, :, 40:], tail)


@pytest.mark.parametrize("products", ["int16", "bf16", "bf16-values"])
def test_other_products_cap_their_scores_as_their_twins(products, monkeypatch):
    """The int16 and bf16 products cap the scores they compute (after the int16 steps): each
    equals its twin under a cap, as without one."""
    if products not in cpu_attention.built_products():
        pytest.skip(f"no {products} products in this build")
    q, k, v = _qkv(1, 6, 2, 130, 430, 128, seed=11)
    q = _spread_queries(q)
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, products)
    got = cpu_attention.prefill_attention(q, k, v, 300, window=100, softcap=1.5)
    if products == "int16":
        twin = cpu_attention.prefill_attention_int16_ref(q, k, v, 300, 100, 1.5)
        torch.testing.assert_close(got, twin, rtol=1e-4, atol=2e-3)
        assert (got - twin).abs().mean() < 2e-6
    else:
        twin = cpu_attention.prefill_attention_bf16_ref(
            q, k, v, 300, products == "bf16", window=100, softcap=1.5
        )
        torch.testing.assert_close(got, twin, rtol=1e-3, atol=2e-3)
        assert (got - twin).abs().mean() < 2e-5
    exact = causal_attention(q, k, v, torch.arange(300, 430), softcap=1.5, window=100)
    torch.testing.assert_close(got, exact, rtol=0, atol=3e-2)
