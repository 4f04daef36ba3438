"""The small C++ decode ops (`kernels/cpu/decode.cpp`) against their eager twins, and a whole
model on its CPU runner against the model itself (the plain PyTorch reference)."""

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.model.rope import apply_rotary
from qspec_core.model.transformer import RMSNorm
from qspec_core.precision import FP, TARGET
from qspec_core.runner import CpuRunner, build_runner

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rms_norm_and_the_fused_residual(rows):
    g = _gen(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x, h = torch.randn(1, rows, 576, generator=g) * 3, torch.randn(1, rows, 576, generator=g)
    with torch.no_grad():
        want = norm(x)  # (the module's own forward: PyTorch)
        want_sum = x + h
        want_after = norm(want_sum)
        got = cpu_ext.load().rms_norm_cpu(x, norm.weight, norm.eps)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        x2 = x.clone()
        got = cpu_ext.load().add_rms_norm_cpu(x2, h, norm.weight, norm.eps)
    torch.testing.assert_close(x2, want_sum)  # the residual stream is updated in place
    torch.testing.assert_close(got, want_after, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T, n, D", [(1, 9, 64), (5, 3, 64), (3, 2, 128), (17, 4, 16)])
def test_rope_in_place_equals_rotate_half(T, n, D):
    g = _gen(T * n * D)
    x = torch.randn(1, T, n * D, generator=g).view(1, T, n, D)  # a projection's output
    angles = torch.rand(T, D // 2, generator=g) * 100
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos(), emb.sin()
    want = apply_rotary(x.transpose(1, 2), cos, sin)  # [1, n, T, D]
    cpu_ext.load().rope_cpu(x, cos, sin)
    torch.testing.assert_close(x.transpose(1, 2), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_kind", ["full", "hierarchical"])
def test_model_steps_equal_the_eager_model(cache_kind):
    """Prefill, then decode and verify-sized steps: logits on the CPU runner (the C++ stack,
    norms, RoPE, few-row linears) equal the model's own (PyTorch's ops) to rounding, each step
    from the same cache (the eager model's, after the steps before it). Not from each path's
    own cache: the hierarchical one rounds K/V to codes, so a last-bit difference in one K value
    can land on the other side of a code's boundary and move later logits by a whole step (one
    lower-plane code of 2,048 did on an AVX2 build tuned for Zen 3: 2e-3 on 6% of the logits)."""
    model = ours_from_hf(tiny_hf("llama", tie_word_embeddings=True))
    runner = build_runner(model)
    assert isinstance(runner, CpuRunner)
    ids = torch.randint(0, 101, (1, 40), generator=_gen(3))
    steps = ((0, 16), (16, 32), (32, 33), (33, 38), (38, 39))
    path = FP if cache_kind == "full" else TARGET

    def eager_cache(before):
        """A cache after the eager model's forwards of `before`, committed."""
        kind = FullPrecisionCache if cache_kind == "full" else HierarchicalKVCache
        cache = kind(model.config, 64, dtype=torch.float32)
        for start, stop in before:
            model(ids[:, start:stop], torch.arange(start, stop), cache, path)
            if cache_kind == "hierarchical":
                cache.commit(stop)
        return cache

    with torch.no_grad():
        for i, (start, stop) in enumerate(steps):
            pos = torch.arange(start, stop)
            want = model(ids[:, start:stop], pos, eager_cache(steps[:i]), path)
            got = runner(ids[:, start:stop], pos, eager_cache(steps[:i]), path)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {start}..{stop}")
