"""QuantSpec's prefill quantizing chunk by chunk (`qspec_core/cache/prefill.py`): what each
chunk attends over, the planes it leaves, memory, interruption, and the C++ dequantizer."""

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from kernels.cpu.dequant import dequantize_into
from kernels.planes import (
    QuantizedGroupTensor,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)
from kernels.reference import causal_attention, causal_mask
from qspec_core.cache import full as full_cache
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.cache.prefill import ChunkedPrefill
from qspec_core.engine.generate import prefill, prefill_hierarchical
from qspec_core.precision import FP, TARGET
from qspec_core.runner import build_runner


class DequantizedHistory:
    """What a chunked prefill computes, written plainly: every position's K/V in full
    precision, and a chunk starting at s reads positions below max(0, (s // G - 1) G) through
    the planes' reference (quantize, then dequantize in the INT8 view)."""

    def __init__(self, config, n: int, G: int):
        shape = (config.num_hidden_layers, 1, config.num_key_value_heads, n, config.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.G, self.seq_len, self.max_seq_len, self.rope_capacity = G, 0, n, n

    def attend(self, layer, q, k, v, input_pos, path=FP):
        s, e = int(input_pos[0]), int(input_pos[-1]) + 1
        self.k[layer, :, :, s:e], self.v[layer, :, :, s:e] = k, v
        nq = max(0, (s // self.G - 1) * self.G)
        hk = dequantize_keys(quantize_keys(self.k[layer, :, :, :nq], self.G), self.G, "int8")
        hv = dequantize_values(quantize_values(self.v[layer, :, :, :nq], self.G), self.G, "int8")
        keys = torch.cat([hk, self.k[layer, :, :, nq:e]], 2)
        values = torch.cat([hv, self.v[layer, :, :, nq:e]], 2)
        self.seq_len = e
        return causal_attention(q, keys, values, input_pos, causal_mask(input_pos, e))

    def commit(self, length):
        pass


def _tiny(**kw):
    return build_runner(ours_from_hf(tiny_hf("llama", **kw)))  # head_dim 16 -> G = 16


def _tokens(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n,chunk", [(5, 8), (40, 8), (83, 16), (100, 48), (64, 64)])
def test_chunks_attend_over_the_int8_history_and_leave_the_bulk_loads_planes(n, chunk):
    """Logits equal the plain computation's; the cache holds bit for bit what a bulk load of
    the same K/V makes (all but the last G..2G tokens quantized)."""
    model = _tiny()
    G = model.config.head_dim
    cache = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    with torch.inference_mode():
        got = prefill_hierarchical(model, cache, _tokens(n), chunk_size=chunk)
        ref = DequantizedHistory(model.config, n, G)
        want = prefill(model, ref, _tokens(n), 0, FP, chunk_size=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    bulk = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    bulk.load_full_precision(ref.k, ref.v)
    assert cache.meta() == bulk.meta()
    assert cache.quantized_len == max(0, (n // G - 1) * G) and cache.committed == n
    for name, tensor in bulk.state().items():
        assert torch.equal(cache.state()[name], tensor), name


def test_a_one_chunk_prompt_is_attended_all_in_full_precision():
    """A prompt that fits one chunk computes what it did before chunking: logits and cache
    bit for bit those of a full-precision prefill and a bulk load."""
    model = _tiny()
    ids = _tokens(70)
    cache = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    with torch.inference_mode():
        got = prefill_hierarchical(model, cache, ids, chunk_size=128)
        fp = FullPrecisionCache(model.config, 70, dtype=torch.float32)
        want = prefill(model, fp, ids, 0, FP, chunk_size=128)
    assert torch.equal(got, want)
    bulk = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    bulk.load_full_precision(fp.k, fp.v)
    for name, tensor in bulk.state().items():
        assert torch.equal(cache.state()[name], tensor), name


def test_no_full_precision_copy_of_the_prompt(monkeypatch):
    """The prefill holds the chunk's tail, not the prompt, in full precision beside the cache."""
    model = _tiny()
    G, chunk = model.config.head_dim, 16
    monkeypatch.setattr(full_cache.FullPrecisionCache, "__init__", _forbidden)
    seen = []
    real_init = ChunkedPrefill.__init__

    def spy(self, cache, chunk_size, products="fp32"):
        real_init(self, cache, chunk_size, products)
        seen.append(self)

    monkeypatch.setattr(ChunkedPrefill, "__init__", spy)
    cache = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    with torch.inference_mode():
        prefill_hierarchical(model, cache, _tokens(150), chunk_size=chunk)
    (scratch,) = seen
    assert scratch.tail_k.shape[3] == chunk + 2 * G < 150
    assert max(scratch.tail_len) < 2 * G


def _forbidden(*args, **kwargs):
    raise AssertionError("a full-precision cache of the whole prompt")


def test_an_interrupted_prefill_leaves_the_cache_empty():
    model = _tiny()
    cache = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    fed = []

    def progress(n):
        fed.append(n)
        if len(fed) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), torch.inference_mode():
        prefill_hierarchical(model, cache, _tokens(100), chunk_size=16, on_progress=progress)
    assert cache.seq_len == 0 and cache.committed == 0 and cache.quantized_len == 0
    with torch.inference_mode():  # and it takes a prefill again, as if nothing happened
        again = prefill_hierarchical(model, cache, _tokens(100), chunk_size=16)
        fresh = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
        assert torch.equal(again, prefill_hierarchical(model, fresh, _tokens(100), chunk_size=16))


def test_positions_go_in_order():
    model = _tiny()
    cache = HierarchicalKVCache(model.config, 160, dtype=torch.float32)
    scratch = ChunkedPrefill(cache, 16)
    q = torch.zeros(1, 4, 4, 16)
    kv = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="in order"):
        scratch.attend(0, q, kv, kv, torch.arange(4, 8), FP)
    with pytest.raises(ValueError, match="'fp' KV view"):
        scratch.attend(0, q, kv, kv, torch.arange(0, 4), TARGET)
    with pytest.raises(ValueError, match="chunk size"):
        big = torch.zeros(1, 2, 64, 16)
        scratch.attend(0, torch.zeros(1, 4, 64, 16), big, big, torch.arange(64), FP)
    cache.load_full_precision(torch.zeros(2, 1, 2, 40, 16), torch.zeros(2, 1, 2, 40, 16))
    with pytest.raises(ValueError, match="empty cache"):
        ChunkedPrefill(cache, 16)


def test_real_model_prefill_stays_close_to_full_precision(real_runtime):
    """SmolLM2 (head dim 64: the tiled C++ attention) over 3 chunks: the last logits within a
    small KL of the full-precision prefill's, the same argmax."""
    from qspec_core.documents import read_document

    runner, config = real_runtime.runner, real_runtime.model.config
    ids = real_runtime.tokenizer.encode(read_document("qspec_core/data/gpl-2.0.txt"))[:1300]
    with torch.inference_mode():
        cache = HierarchicalKVCache(config, 1400, dtype=torch.float32)
        got = prefill_hierarchical(runner, cache, ids)
        fp = FullPrecisionCache(config, len(ids), dtype=torch.float32)
        want = prefill(runner, fp, ids, 0)
    p, q = torch.softmax(want.double(), -1), torch.softmax(got.double(), -1)
    kl = float((p * (p.log() - q.log())).sum())
    assert kl < 0.01 and int(got.argmax()) == int(want.argmax())
    assert cache.quantized_len == (1300 // 64 - 1) * 64


@pytest.mark.skipif(not cpu_ext.available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("D,G", [(64, 64), (128, 64), (80, 16), (96, 32), (16, 16)])
@pytest.mark.parametrize("view", ["int8", "int4"])
def test_cpu_dequantizer_equals_the_planes_reference(D, G, view):
    """Bit for bit, on the cache's own strided slices (one layer of [L, B, n_kv, S, D/2])."""
    g = torch.Generator().manual_seed(D + G)
    T, n_kv = 5 * G, 3
    k = torch.randn(2, n_kv, T, D, generator=g) * 4 + 1
    v = torch.randn(2, n_kv, T, D, generator=g) * 0.1
    for keys, x in ((True, k), (False, v)):
        planes = quantize_keys(x, G) if keys else quantize_values(x, G)
        twin = (dequantize_keys if keys else dequantize_values)(planes, G, view)
        planes = QuantizedGroupTensor(*(_padded(t) for t in vars(planes).values()))
        out = torch.full((2, n_kv, T + 7, D), float("nan"))[:, :, :T]  # (a strided slice)
        dequantize_into(planes, G, keys, view, out)
        assert torch.equal(out, twin)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t as a slice of a longer buffer (dim 2), as the cache's planes are read."""
    return torch.cat([t, torch.zeros_like(t)], 2)[:, :, : t.shape[2]]
