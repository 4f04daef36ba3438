import math

import pytest
import torch

from qspec_core.engine.sampling import SamplingParams, probabilities, sample


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams(), None), logits.argmax(-1))


def test_top_k_and_top_p_supports():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it -> two tokens
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.3))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = probabilities(logits, SamplingParams(temperature=2.0))[0, 0]
    cold = probabilities(logits, SamplingParams(temperature=0.5))[0, 0]
    assert cold > 1 / (1 + math.exp(-1)) > hot


def test_seeded_runs_reproduce():
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0)
    a = [int(sample(logits, params, torch.Generator().manual_seed(7))) for _ in range(3)]
    b = [int(sample(logits, params, torch.Generator().manual_seed(7))) for _ in range(3)]
    assert a == b


def test_sampled_frequencies_follow_the_distribution():
    # n = 20000 draws from 4 outcomes; each frequency's std is <= 0.0036, bound at ~5 sigma.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().expand(20000, 4)
    draws = sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert (freq - probs).abs().max() < 0.018


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}])
def test_rejects_bad_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
