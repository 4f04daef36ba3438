"""A sliding-window layer's planes in the hierarchical cache hold a window's worth of
positions, not the context: the groups no later query sees are dropped, and nothing a query
sees changes (bit for bit on the C++ attention, whose positions stay absolute)."""

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import attention as cpu_attention
from qspec_core.cache import prefill as chunked
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import (
    K_GROUPED,
    LOCAL,
    PLANE_BUFFERS,
    HierarchicalKVCache,
    local_slots,
)
from qspec_core.engine.generate import prefill_hierarchical
from qspec_core.precision import DRAFT_KV4, TARGET
from qspec_core.runner import build_runner

WINDOW, LONG = 16, 400  # 25 windows; head_dim 16 -> G = 16
# Qwen2 with its window from layer 1 on: layer 0 global, layer 1 local (one layer per stack)
QWEN = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _runner():
    return build_runner(ours_from_hf(tiny_hf("qwen2", max_position_embeddings=1024, **QWEN)))


def _tokens(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, cache, tokens, path, fused=None):
    """Prefill the first half in chunks of 64, then decode the rest a token at a time
    (committing each): the logits of every decode step, [steps, V]."""
    cache.fused = fused
    half = len(tokens) // 2
    with torch.no_grad():
        prefill_hierarchical(model, cache, tokens[:half], chunk_size=64)
        out = []
        for p in range(half, len(tokens)):
            out.append(model(torch.tensor([[tokens[p]]]), torch.tensor([p]), cache, path)[0, -1])
            cache.commit(p + 1)
    return torch.stack(out)


def _never_dropping(model, size):
    """A cache whose local stack is as long as the context: no group is ever dropped."""
    cache = HierarchicalKVCache(model.config, size, dtype=torch.float32)
    cache._resize(LOCAL, cache.k_upper.shape[3])
    return cache


@pytest.mark.parametrize("path", [TARGET, DRAFT_KV4], ids=["target", "draft"])
@pytest.mark.parametrize("fused", [None, False], ids=["kernel", "reference"])
def test_dropping_what_no_query_sees_changes_no_logit(path, fused):
    model = _runner()
    assert model.config.windows == (None, WINDOW)
    tokens = _tokens(LONG)
    windowed = HierarchicalKVCache(model.config, LONG, dtype=torch.float32)
    got = _run(model, windowed, tokens, path, fused)
    want = _run(model, _never_dropping(model, LONG), tokens, path, fused)
    if fused is None and windowed.native is not None:  # (absolute positions: the same bits)
        assert torch.equal(got, want)
    else:  # (the reference counts positions from the base: a softmax over fewer keys)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    G = windowed.group_size
    held = windowed.local_k_upper.shape[3]  # (positions the local layer's planes hold)
    assert LONG - windowed.base[1] <= held + 3 * G and windowed.base[0] == 0
    assert held <= local_slots(WINDOW, G) + 64 + 2 * G  # (and a prefill chunk's groups)
    assert windowed.k_upper.shape[0] == 1 and windowed.local_k_upper.shape[0] == 1


def test_the_local_stack_stays_a_windows_size_at_any_context():
    """At 8x the context, the local layer's planes and the cache's bytes for it stay put."""
    model = _runner()
    sizes = {}
    for n in (128, 1024):
        cache = HierarchicalKVCache(model.config, n, dtype=torch.float32)
        with torch.no_grad():
            prefill_hierarchical(model, cache, _tokens(n), chunk_size=64)
        state = cache.state()
        sizes[n] = (cache.local_k_upper.shape[3], state[LOCAL + "k_upper"].shape[3])
        assert state["k_upper"].shape[3] == cache.quantized_len  # (the global layer: all)
    assert sizes[1024] == sizes[128] and sizes[128][1] <= 2 * WINDOW + 16


def test_a_checkpoint_survives_the_drops_after_it():
    """A chat's document point: answers past it drop the local groups it needs, and
    restoring it brings them back (the next answer's logits as a fresh prefill gives)."""
    model = _runner()
    tokens, more = _tokens(200), _tokens(300, seed=1)
    cache = HierarchicalKVCache(model.config, 600, dtype=torch.float32)
    with torch.no_grad():
        prefill_hierarchical(model, cache, tokens, chunk_size=64)
        point = cache.checkpoint()
        base = cache.base[1]
        for i, t in enumerate(more):  # far past the window: the groups at the point drop
            model(torch.tensor([[t]]), torch.tensor([200 + i]), cache, TARGET)
            cache.commit(201 + i)
        assert cache.base[1] > point.n_quant
        cache.restore(point)
        assert cache.base[1] == point.local_base >= base
        got = model(torch.tensor([[7]]), torch.tensor([200]), cache, TARGET)
        fresh = HierarchicalKVCache(model.config, 600, dtype=torch.float32)
        prefill_hierarchical(model, fresh, tokens, chunk_size=64)
        want = model(torch.tensor([[7]]), torch.tensor([200]), fresh, TARGET)
    assert torch.equal(got, want)


def test_a_state_with_every_layer_from_position_0_loads_its_window():
    """A snapshot from before windowed caches (version 1: each layer's planes from 0) loads:
    the local layer keeps the groups its later queries see, and decodes as the original."""
    model = _runner()
    tokens = _tokens(300)
    cache = _never_dropping(model, 320)
    with torch.no_grad():
        prefill_hierarchical(model, cache, tokens, chunk_size=64)
    meta, state = cache.meta(), cache.state()
    nq, G = meta["n_quant"], cache.group_size
    old = {"fp_k": state["fp_k"], "fp_v": state["fp_v"]}
    for name in PLANE_BUFFERS:  # (never dropped: the local stack holds [0, n_quant) too)
        n = nq // G if name in K_GROUPED else nq
        parts = (getattr(cache, name), getattr(cache, LOCAL + name))  # layers 0, 1
        old[name] = torch.cat([t[:, :, :, :n] for t in parts])
    loaded = HierarchicalKVCache(model.config, 320, dtype=torch.float32)
    loaded.load_state(old, meta)
    assert loaded.base[1] > 0 and loaded.meta()["local_base"] == loaded.base[1]
    with torch.no_grad():
        got = model(torch.tensor([[5]]), torch.tensor([300]), loaded, TARGET)
        want = model(torch.tensor([[5]]), torch.tensor([300]), cache, TARGET)
    assert torch.equal(got, want)


TILED_CASES = {  # head_dim 64 (the tiled C++ prefill attention's), layer 1 local / layer 0 local
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1},
    "gemma2": {  # (a cap low enough to bend the scores: a kernel without it shows)
        "head_dim": 64,
        "query_pre_attn_scalar": 48,
        "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 2.0,
        "attn_implementation": "eager",  # (transformers' SDPA path has no soft cap)
    },
}


@pytest.mark.parametrize("family", list(TILED_CASES))
def test_a_local_layers_prefill_chunks_run_the_tiled_kernel_with_its_window(family, monkeypatch):
    """At head_dim 64 (the tiled C++ prefill attention's), a local layer's prefill chunks past
    its window run that kernel with the window (and Gemma 2's soft cap), on both caches: the
    full-precision one's logits are transformers', and the hierarchical one's chunked prefill
    gives the reference's to rounding (the same chunks with the tiled kernel turned off; fp32
    products). A kernel without the cap is off by more than 1e-2 here."""
    if not cpu_attention.prefill_usable(*[torch.zeros(1, 2, 32, 64)] * 3):
        pytest.skip("the tiled C++ prefill attention is not built here")
    window, n = 40, 300
    hf = tiny_hf(
        family,
        max_position_embeddings=1024,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=window,
        **TILED_CASES[family],
    )
    model = build_runner(ours_from_hf(hf))
    assert window in model.config.windows and model.config.head_dim == 64
    cap = model.config.attn_logit_softcapping
    windows, caps = [], set()
    real = cpu_attention.prefill_attention

    def spy(*a):
        windows.append(a[5])
        caps.add(a[6])
        return real(*a)

    monkeypatch.setattr(cpu_attention, "prefill_attention", spy)
    monkeypatch.setenv(cpu_attention.PRODUCTS_ENV, "fp32")  # (the reference's numbers)
    tokens = _tokens(n)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0, -1]
        full = FullPrecisionCache(model.config, n, dtype=torch.float32)
        got = model(torch.tensor([tokens]), torch.arange(n), full)[0, -1]
        assert window in windows and caps == {cap}  # (the local layer's chunk, on the kernel)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

        def chunked_logits():
            cache = HierarchicalKVCache(model.config, n, dtype=torch.float32)
            return prefill_hierarchical(model, cache, tokens, chunk_size=64)

        windows.clear()
        tiled = chunked_logits()
        assert window in windows
        monkeypatch.setattr(chunked, "prefill_usable", lambda *a: False)  # (its mask)
        monkeypatch.setattr(cpu_attention, "prefill_usable", lambda *a: False)
        windows.clear()
        reference = chunked_logits()
        assert window not in windows
    # (the two round differently, so a key or value at a code's midpoint lands on another
    # INT8 code: 1 to 3 of 10,240 in these planes, which moves a logit by about 1e-4)
    torch.testing.assert_close(tiled, reference, atol=3e-4, rtol=3e-4)
    assert not torch.equal(tiled, reference)  # (two implementations ran)
