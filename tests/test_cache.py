"""Cached decoding equals an uncached forward over the same tokens."""

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.engine.generate import prefill


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_incremental_equals_full_forward(model_type, chunk):
    model = ours_from_hf(tiny_hf(model_type))
    tokens = torch.randint(0, 101, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(
            tokens, torch.arange(50), FullPrecisionCache(model.config, 64, dtype=torch.float32)
        )
        cache = FullPrecisionCache(model.config, 64, dtype=torch.float32)
        pieces = []
        for start in range(0, 50, chunk):
            piece = tokens[:, start : start + chunk]
            pos = torch.arange(start, start + piece.shape[1])
            pieces.append(model(piece, pos, cache))
    assert cache.seq_len == 50
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=1e-4)


def test_prefill_returns_last_logits_and_rewrite_rolls_back():
    model = ours_from_hf(tiny_hf("llama"))
    a = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    b = torch.randint(0, 101, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = FullPrecisionCache(model.config, 64, dtype=torch.float32)
    prefill(model, cache, a, 0, chunk_size=8)
    prefill(model, cache, b, 30, chunk_size=8)
    cache.truncate(30)  # roll back b ...
    got = prefill(model, cache, b[:5], 30, chunk_size=8)  # ... and take another path
    fresh = FullPrecisionCache(model.config, 64, dtype=torch.float32)
    expected = prefill(model, fresh, a + b[:5], 0, chunk_size=64)
    assert cache.seq_len == 35
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_cache_refuses_gaps_and_overflow():
    model = ours_from_hf(tiny_hf("llama"))
    cache = FullPrecisionCache(model.config, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="gap"):
        model(torch.tensor([[1]]), torch.tensor([3]), cache)
    with pytest.raises(ValueError, match="beyond"):
        model(torch.ones(1, 17, dtype=torch.long), torch.arange(17), cache)
    with pytest.raises(ValueError):
        cache.truncate(1)
