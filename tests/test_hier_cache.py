"""The hierarchical INT4/INT8 cache: attention, rotation, rollback, commit invariant, state."""

import copy
from functools import partial

import pytest
import torch
from error_model import assert_within_error_model, attention64, hier_attention64
from hf_tiny import ours_from_hf, tiny_hf

from kernels.planes import HierLayerView, QueryRows, quantize_keys, quantize_values
from kernels.reference import dequantize_history, hier_attention_ref
from qspec_core.cache import hierarchical as hier_cache
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import CommitInvariantError, HierarchicalKVCache
from qspec_core.engine.generate import prefill, prefill_hierarchical
from qspec_core.precision import DRAFT_KV4, FP, TARGET, Precision
from qspec_core.runner import build_runner

# The paths of a model without 4-bit weights: full weights over the INT8 or the INT4 view.
PATHS = {"target": TARGET, "draft": DRAFT_KV4}

# The fused path's error may be this many times PyTorch's: 2x the worst seen (6.45, a late
# draft query with QSPEC_CPU_ISA=avx2; the kernel folds the zeros into the scores, q.s c + q.z,
# which loses to cancellation where |z| is large)
FUSED_FACTOR = 13


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("n_kv,rep", [(1, 4), (2, 2), (4, 1), (2, 3)])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("n_quant,n_fp,T", [(0, 5, 1), (96, 17, 1), (160, 40, 6), (64, 1, 1)])
def test_reference_attention_equals_dense(n_kv, rep, D, n_quant, n_fp, T, kv):
    """The PyTorch reference (the cache's no-kernel path) equals plain causal attention, in
    float64, over the history as the planes hold it followed by the full-precision region."""
    B, H, G, g = 2, n_kv * rep, 32, _gen(0)
    kq = quantize_keys(torch.randn(B, n_kv, n_quant + G, D, generator=g) * 2 + 1, G)
    vq = quantize_values(torch.randn(B, n_kv, n_quant + G, D, generator=g), G)
    fp_k = torch.randn(B, n_kv, n_fp, D, generator=g)
    fp_v = torch.randn(B, n_kv, n_fp, D, generator=g)
    q = torch.randn(B, H, T, D, generator=g)
    pos = torch.arange(n_quant + n_fp - T, n_quant + n_fp)
    view = HierLayerView(kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale,
                         vq.zero, fp_k, fp_v, fp_pos0=n_quant, group_size=G)  # fmt: skip
    rows = QueryRows(torch.full((T,), n_quant), torch.zeros(T, dtype=torch.long), pos)
    got = hier_attention_ref(q, view, rows, kv)
    hist_k, hist_v = dequantize_history(view, n_quant, kv, torch.float64)
    k, v = torch.cat([hist_k, fp_k.double()], 2), torch.cat([hist_v, fp_v.double()], 2)
    causal = torch.arange(n_quant + n_fp)[None, :] <= pos[:, None]  # [T, S]
    want = attention64(q, k, v, causal)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _tiny(**kw):
    """A tiny model's runner (what qspec runs it with: the C++ kernels where built); it has
    the model's `config` and call."""
    return build_runner(ours_from_hf(tiny_hf("llama", **kw)))  # head_dim 16 -> G = 16


def _cache(model, size=160, **kw):
    return HierarchicalKVCache(model.config, size, dtype=torch.float32, **kw)


def _feed(model, cache, tokens, start, path=TARGET):
    """One forward of `tokens` at positions start..; returns logits [T, V]."""
    pos = torch.arange(start, start + len(tokens))
    with torch.no_grad():
        return model(torch.tensor([tokens]), pos, cache, path)[0]


def _tokens(n, seed=0):
    return torch.randint(0, 101, (n,), generator=_gen(seed)).tolist()


def test_cache_attention_equals_dense_over_dequantized_view():
    model = _tiny()
    cache = _cache(model)
    ids = _tokens(70)
    prefill(model, cache, ids, 0, TARGET, chunk_size=16)
    assert cache.quantized_len == 48 and cache.fp_len[-1] == 22
    g, layer = _gen(1), 1
    q = torch.randn(1, 4, 3, 16, generator=g)
    k_new, v_new = torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    for path in (TARGET, DRAFT_KV4):
        cache.truncate(70)
        hist_k, hist_v = dequantize_history(cache.layer_view(layer), 48, path.kv)
        fp_k = torch.cat([cache.fp_k[layer, :, :, :22], k_new], 2)
        fp_v = torch.cat([cache.fp_v[layer, :, :, :22], v_new], 2)
        pos = torch.arange(70, 73)
        got = cache.attend(layer, q, k_new, v_new, pos, path)
        causal = torch.arange(73)[None, :] <= pos[:, None]  # [T, S]
        expected = attention64(
            q, torch.cat([hist_k, fp_k], 2), torch.cat([hist_v, fp_v], 2), causal
        )
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["target", "draft"])
@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}, {"head_dim": 32}])
def test_token_by_token_equals_group_aligned_prefill(path, overrides):
    """AR decoding through a path gives the same KV as re-prefilling in G-aligned chunks."""
    path = PATHS[path]
    model = _tiny(**overrides)
    G = model.config.head_dim
    ids = _tokens(3 * G + 7)
    step = _cache(model)
    for i, t in enumerate(ids):
        logits_step = _feed(model, step, [t], i, path)[-1]
        step.commit(i + 1)
    chunked = _cache(model)
    logits_chunk = prefill(model, chunked, ids, 0, path, chunk_size=G)
    assert step.n_quant == chunked.n_quant and step.quantized_len == 2 * G
    torch.testing.assert_close(logits_step, logits_chunk, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", [None, False])
def test_speculative_like_rounds_equal_a_replay_of_the_committed_tokens(fused):
    """Draft writes, verify overwrites, rejections, commits, rotations: the cache must equal
    one that saw only the committed tokens in the same verify forwards. With the fused
    attention (None: the kernel of this device) and with the PyTorch reference (False)."""
    model = _tiny()
    prompt = _tokens(37)
    spec, replay = _cache(model, 256), _cache(model, 256)
    spec.fused = replay.fused = fused
    prefill(model, spec, prompt, 0, TARGET, chunk_size=16)
    prefill(model, replay, prompt, 0, TARGET, chunk_size=16)
    committed = list(prompt)
    g = _gen(5)
    gamma = 4
    for _ in range(25):
        c = len(committed)
        drafts = torch.randint(0, 101, (gamma,), generator=g).tolist()
        next_tok = int(torch.randint(0, 101, (1,), generator=g))
        for i, t in enumerate([next_tok] + drafts[:-1]):  # draft path appends to F2
            _feed(model, spec, [t], c + i, DRAFT_KV4)
        _feed(model, spec, [next_tok] + drafts, c, TARGET)  # verify overwrites
        n_acc = int(torch.randint(0, gamma + 1, (1,), generator=g))
        spec.truncate(c + 1 + n_acc)
        spec.commit(c + 1 + n_acc)
        accepted = [next_tok] + drafts[:n_acc]
        _feed(model, replay, accepted, c, TARGET)
        replay.commit(c + len(accepted))
        committed += accepted
    assert spec.seq_len == replay.seq_len == len(committed) and spec.quantized_len >= 80
    assert spec.n_quant == replay.n_quant
    probe = int(torch.randint(0, 101, (1,), generator=g))
    a = _feed(model, spec, [probe], len(committed))[-1]
    b = _feed(model, replay, [probe], len(committed))[-1]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rollback_to_committed_middle_and_full():
    model = _tiny()
    cache = _cache(model)
    prefill(model, cache, _tokens(40), 0, TARGET, chunk_size=16)
    assert cache.quantized_len == 16
    _feed(model, cache, _tokens(5, 1), 40)
    cache.truncate(45)  # full: nothing to drop
    assert cache.seq_len == 45
    cache.truncate(42)  # middle of F2
    assert cache.seq_len == 42 and cache.committed == 40
    cache.truncate(40)  # back to the committed length
    with pytest.raises(ValueError, match="quantized"):
        cache.truncate(10)  # into the quantized history
    empty = _cache(model)
    _feed(model, empty, _tokens(3), 0)
    empty.truncate(0)  # to 0 while nothing is quantized
    assert empty.seq_len == 0


def test_f2_fills_to_capacity_then_rotates_once():
    model = _tiny()
    G = model.config.head_dim
    cache = _cache(model)
    prefill(model, cache, _tokens(2 * G), 0, TARGET, chunk_size=G)
    assert cache.n_quant[0] == 0 and cache.fp_len[0] == 2 * G  # exactly full, no rotation
    _feed(model, cache, [7], 2 * G)
    assert cache.n_quant == [G] * 2 and cache.fp_len == [G + 1] * 2


def test_unconfirmed_kv_is_never_quantized():
    model = _tiny()
    G = model.config.head_dim
    cache = _cache(model)
    for i, t in enumerate(_tokens(3 * G)):  # draft-path writes, never committed
        _feed(model, cache, [t], i, DRAFT_KV4)
    assert cache.quantized_len == 0  # rotation follows the committed length only
    with pytest.raises(ValueError, match="does not fit"):
        _feed(model, cache, [1], 3 * G, DRAFT_KV4)
    with pytest.raises(CommitInvariantError, match="confirmed"):
        cache._rotate(0)  # even asked directly
    cache.truncate(2 * G)
    cache.commit(2 * G)  # now F1 is confirmed and no query needs it in full precision
    _feed(model, cache, [1], 2 * G, DRAFT_KV4)
    assert cache.quantized_len == G


def test_prefill_keeps_g_to_2g_recent_tokens():
    """(What each chunk attends over: tests/test_chunked_prefill.py.)"""
    model = _tiny()
    G = model.config.head_dim
    for n in (5, G, 2 * G - 1, 2 * G, 5 * G + 3):
        cache = _cache(model)
        prefill_hierarchical(model, cache, _tokens(n), chunk_size=8)
        expected_q = max(0, (n // G - 1) * G)
        assert cache.quantized_len == expected_q and cache.seq_len == n == cache.committed
        assert cache.fp_len[-1] < 2 * G and (n < 2 * G or cache.fp_len[-1] >= G)


def test_views_differ_and_target_is_closer_to_full_precision():
    model = _tiny()
    ids = _tokens(150)
    fp = FullPrecisionCache(model.config, 160, dtype=torch.float32)
    ref = prefill(model, fp, ids, 0)
    errs = {}
    for path in ("target", "draft"):
        cache = _cache(model)
        prefill_hierarchical(model, cache, ids[:-1])
        errs[path] = (_feed(model, cache, ids[-1:], 149, PATHS[path])[-1] - ref).abs().max()
    assert 0 < errs["target"] < errs["draft"] / 4


def test_state_round_trip_and_byte_accounting():
    model = _tiny()
    cache = _cache(model)
    prefill_hierarchical(model, cache, _tokens(75))
    state, meta = cache.state(), cache.meta()
    nbytes = cache.nbytes()
    assert nbytes["payload"] == sum(
        state[n].numel() for n in ("k_upper", "k_lower", "v_upper", "v_lower")
    )
    assert nbytes["scales"] == sum(
        state[n].nbytes for n in ("k_scale", "k_zero", "v_scale", "v_zero")
    )
    assert nbytes["full_precision"] == state["fp_k"].nbytes + state["fp_v"].nbytes
    assert cache.bytes_per_token("int4") < cache.bytes_per_token("int8")
    copy = _cache(model)
    copy.load_state(state, meta)
    torch.testing.assert_close(_feed(model, copy, [3], 75), _feed(model, cache, [3], 75))


def test_paths_are_checked():
    model = _tiny()
    with pytest.raises(ValueError, match="serves the KV views"):
        _feed(model, _cache(model), [1], 0, FP)
    with pytest.raises(ValueError, match="serves the KV views"):
        _cache(model).attend(0, *torch.zeros(3, 1, 2, 1, 16), torch.tensor([0]), "target")
    with pytest.raises(ValueError, match="serves the 'fp' KV view"):
        _feed(model, FullPrecisionCache(model.config, 8, dtype=torch.float32), [1], 0, TARGET)
    with pytest.raises(ValueError, match="kv must be one of"):
        Precision("full", "int2")


@pytest.mark.parametrize(
    "path, rounded",
    [
        (Precision("w8a8", "int8"), True),  # the CPU's default target
        (Precision("int4", "int4"), True),  # the draft (W4A8 on a CPU)
        (TARGET, False),  # full weights keep fp32 queries, and so does W8A16
        (Precision("int8", "int8"), False),
        (DRAFT_KV4, False),
    ],
)
def test_paths_whose_activations_are_int8_round_their_queries(monkeypatch, path, rounded):
    """The integer queries reach the kernel from both ways in: a layer's `attend` (the C++
    `HierKV`'s step, or `hier_attention` without one) and the C++ stack's one-call step
    (`native_step`); no other path gets them."""
    assert path.int_queries is rounded
    model = _tiny()
    cache = _cache(model)
    calls = []
    real = hier_cache.hier_attention
    monkeypatch.setattr(
        hier_cache,
        "hier_attention",
        lambda *a, **k: calls.append(k["int_queries"]) or real(*a, **k),
    )
    real_step = cache._step
    # (_step's 8th argument: int_queries)
    monkeypatch.setattr(cache, "_step", lambda *a: calls.append(a[7]) or real_step(*a))
    q = torch.zeros(1, model.config.num_attention_heads, 1, model.config.head_dim)
    kv = torch.zeros(1, model.config.num_key_value_heads, 1, model.config.head_dim)
    cache.attend(0, q, kv, kv, torch.tensor([0]), path)
    assert calls == [rounded]
    step = _cache(model).native_step(torch.tensor([0]), path, 1)
    if cache.native is not None:  # (else no C++ stack to step)
        assert step.int_queries is rounded


class _Float64Reference:
    """The tiny model's forward in float64 over a copy of a cache's state: float64 weights,
    norms that normalize in float64 (the model's own normalize in fp32, as HF does), and
    float64 attention over the same K/V (planes, a late query's F1 staged in them included,
    dequantized exactly: `error_model.hier_attention64`)."""

    def __init__(self, model, monkeypatch):
        self.model = copy.deepcopy(model.model).double()  # (the runner's model, plain)
        for module in self.model.modules():
            if type(module).__name__ == "RMSNorm":
                module.forward = partial(_rms_norm64, module)
        self.fp32_attention = hier_cache.hier_attention
        monkeypatch.setattr(hier_cache, "hier_attention", self.attention)

    def attention(
        self, q, view, rows, kv, chunk_size=None, fused=True, int_queries=False, softcap=None
    ):
        """`kernels.attention.hier_attention` for the float64 cache; the real one for others."""
        if q.dtype != torch.float64:
            return self.fp32_attention(q, view, rows, kv, chunk_size, fused, int_queries, softcap)
        assert not int_queries and softcap is None  # (these paths: fp32 queries, no cap)
        return hier_attention64(q, view, rows, kv)

    def feed(self, source, tokens, start, path):
        cache = _copy(self.model, source, torch.float64)
        for name in ("k_scale", "k_zero", "v_scale", "v_zero"):  # exact dequantization
            setattr(cache, name, getattr(cache, name).double())
        return _feed(self.model, cache, tokens, start, path)


def _rms_norm64(norm, x):
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def _copy(model, source, dtype=torch.float32):
    """A reference-path cache holding `source`'s state."""
    cache = HierarchicalKVCache(model.config, source.max_seq_len, dtype=dtype)
    cache.load_state(source.state(), source.meta())
    cache.fused = False
    return cache


def test_fused_attention_equals_the_reference_through_rounds_with_late_queries(monkeypatch):
    """The fused kernel and the reference (both reading a late query's F1 staged into the
    planes) give the same logits on both paths, round after round.

    Both run each forward from the same state: the fused cache goes through the rounds (its
    staging carries over between forwards, as in decoding) and every forward runs again on a
    copy of its state with the reference. (Two caches that evolve apart drift: one layer's
    rounding moves a later K/V value across a quantization step, and from then on they hold
    different codes.) Tolerance from `error_model.py`, against the float64 forward of the
    same state: this fused path (its linears, norms and attention all round differently)
    measured at most 4.2x (native, AVX-512), 6.45x (avx2) and 4.3x (generic) PyTorch's fp32
    error over these 100 forwards, 1.5x at the median."""
    from kernels.cpu import attention as cpu_attention

    if not cpu_attention.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    model = _tiny()
    exact = _Float64Reference(model, monkeypatch)
    fused = _cache(model, 256)
    kernel_runs = []  # steps of `fused` for its C++ `HierKV` (the stack's, or a layer's)
    make_step = fused._step
    monkeypatch.setattr(fused, "_step", lambda *a: kernel_runs.append(a) or make_step(*a))
    prompt = _tokens(30)
    prefill(model, fused, prompt, 0, TARGET, chunk_size=16)
    g, c, late_seen = _gen(9), len(prompt), {DRAFT_KV4: 0, TARGET: 0}
    for rnd in range(20):
        drafts = torch.randint(0, 101, (5,), generator=g).tolist()
        forwards = [([t], c + i, DRAFT_KV4) for i, t in enumerate(drafts[:-1])]
        for tokens, start, path in [*forwards, (drafts, c, TARGET)]:
            want64 = exact.feed(fused, tokens, start, path)
            want = _feed(model, _copy(model, fused), tokens, start, path)
            got = _feed(model, fused, tokens, start, path)
            # (after the forward, which may have rotated)
            late = fused._boundary(torch.arange(start, start + len(tokens))) > fused.n_quant[0]
            late_seen[path] += bool(late.any())
            what = f"round {rnd}, {path} at {start}, late queries {late.tolist()}"
            assert_within_error_model(got, want, want64, FUSED_FACTOR, what=what)
        n = int(torch.randint(1, 6, (1,), generator=g))
        fused.truncate(c + n)
        fused.commit(c + n)
        c += n
    assert kernel_runs  # (the fused kernels ran, not the reference)
    assert min(late_seen.values()) >= 3 and fused.quantized_len >= 48, late_seen
