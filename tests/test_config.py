import pytest

from qspec_core.config import ModelConfig
from qspec_core.errors import UnsupportedModelError

BASE = dict(
    vocab_size=10,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
)


def test_derives_head_dim_and_kv_heads_and_ignores_unknown_keys():
    cfg = ModelConfig.from_hf_config({**BASE, "model_type": "llama", "some_new_key": 1})
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.n_rep == 1


def test_transformers4_rope_format():
    cfg = ModelConfig.from_hf_config(
        {
            **BASE,
            "model_type": "llama",
            "rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert cfg.rope_type == "linear" and cfg.rope_theta == 5e5


@pytest.mark.parametrize(
    "hf,match",
    [
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}, "longrope"),
        (
            {
                "model_type": "llama",
                "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5},
            },
            "partial rotary",
        ),
    ],
)
def test_refuses_what_it_cannot_run(hf, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_config({**BASE, **hf})


def test_sliding_window_caps_the_context():
    mistral = ModelConfig.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 1024})
    assert mistral.context_limit == 1024  # within the window SWA equals full attention
    qwen_off = ModelConfig.from_hf_config(
        {**BASE, "model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False}
    )
    assert qwen_off.context_limit == 4096 and qwen_off.qkv_bias
    qwen_on = ModelConfig.from_hf_config(
        {
            **BASE,
            "model_type": "qwen2",
            "sliding_window": 1024,
            "use_sliding_window": True,
            "max_window_layers": 1,
        }
    )
    assert qwen_on.context_limit == 1024
