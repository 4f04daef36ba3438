"""Our forward vs transformers' on identical weights (fp32, tight bound)."""

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from qspec_core.cache.full import FullPrecisionCache

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
}
CASES = [
    ("llama", {}, "default"),
    ("llama", {"num_key_value_heads": 4}, "default"),  # MHA
    ("llama", {"num_key_value_heads": 1}, "default"),  # MQA
    ("llama", {"attention_bias": True, "mlp_bias": True}, "default"),
    ("llama", {"tie_word_embeddings": True}, "default"),
    ("llama", {}, "linear"),
    ("llama", {}, "dynamic"),
    ("llama", {}, "llama3"),
    ("llama", {}, "yarn"),
    ("qwen2", {}, "default"),
    ("qwen2", {}, "yarn"),
    ("mistral", {"head_dim": 24}, "default"),  # head_dim != hidden / heads
]


def _forward(model, tokens):
    cache = FullPrecisionCache(model.config, 128, batch_size=tokens.shape[0], dtype=torch.float32)
    return model(tokens, torch.arange(tokens.shape[1]), cache)


@pytest.mark.parametrize("model_type,overrides,rope", CASES)
def test_logits_match_transformers(model_type, overrides, rope):
    if ROPE[rope] is not None:
        overrides = {**overrides, "rope_scaling": ROPE[rope]}
    hf = tiny_hf(model_type, **overrides)
    ours = ours_from_hf(hf)
    assert ours.config.rope_type == rope
    # dynamic NTK only changes frequencies past max_position_embeddings (64)
    tokens = torch.randint(
        0, 101, (2, 80 if rope == "dynamic" else 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(tokens).logits
        got = _forward(ours, tokens)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
def test_rope_scaling_changes_logits(rope):
    """Guards the parity test: a scaling type silently read as 'default' would fail here."""
    tokens = torch.randint(0, 101, (1, 48), generator=torch.Generator().manual_seed(2))
    plain = ours_from_hf(tiny_hf("llama"))
    scaled = ours_from_hf(tiny_hf("llama", rope_scaling=ROPE[rope]))
    with torch.no_grad():
        assert not torch.allclose(_forward(plain, tokens), _forward(scaled, tokens), atol=1e-3)
