import pytest
from conftest import TINY_SHAPE

from qspec_core.config import ConfigError, ModelConfig
from qspec_core.errors import UnsupportedModelError

BASE = dict(TINY_SHAPE, vocab_size=10, max_position_embeddings=4096)  # KV heads derived


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
        (
            {
                "model_type": "llama",
                "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1},
            },
            "partial rotary of 1 channels",
        ),
        ({"model_type": "phi3", "partial_rotary_factor": 0.45}, "partial rotary of 7 channels"),
    ],
)
def test_refuses_what_it_cannot_run(hf, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_config({**BASE, **hf})


def test_sliding_windows_follow_each_family_and_leave_the_context_whole():
    """Which layers are local, as transformers reads the same config.json; the context is
    max_position_embeddings whatever the window (the caches apply it per layer)."""
    mistral = ModelConfig.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 1024})
    assert mistral.windows == (1024, 1024) and mistral.context_limit == 4096
    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 1024}
    qwen_off = ModelConfig.from_hf_config({**qwen, "use_sliding_window": False})
    assert qwen_off.windows == (None, None) and qwen_off.layer.qkv_bias
    on = {**qwen, "use_sliding_window": True}
    qwen_on = ModelConfig.from_hf_config({**on, "max_window_layers": 1})
    assert qwen_on.windows == (None, 1024) and qwen_on.context_limit == 4096
    qwen_default = ModelConfig.from_hf_config(on)
    assert qwen_default.windows == (None, None)  # (max_window_layers 28: no layer of 2 slides)
    four = {**BASE, "num_hidden_layers": 4, "sliding_window": 8}
    gemma2 = ModelConfig.from_hf_config({**four, "model_type": "gemma2", "head_dim": 16})
    assert gemma2.windows == (8, None, 8, None)  # (transformers' alternation: even layers)
    gemma3 = ModelConfig.from_hf_config({**four, "model_type": "gemma3_text", "head_dim": 16})
    assert gemma3.windows == (8,) * 4  # (a pattern of 6: the 6th layer is the first global)
    listed = {**four, "layer_types": ["full_attention", "sliding_attention"] * 2}
    assert ModelConfig.from_hf_config({**listed, "model_type": "gemma3_text"}).windows == (
        None, 8, None, 8,
    )  # fmt: skip
    llama = ModelConfig.from_hf_config({**four, "model_type": "llama"})
    assert llama.windows == (None,) * 4  # (Llama has no window, whatever the key says)


LLAMA = {**BASE, "model_type": "llama"}


@pytest.mark.parametrize(
    "hf,match",
    [
        ([], "expected a JSON object, not a list"),
        ("llama", "expected a JSON object, not a string"),
        ({**LLAMA, "hidden_size": "576"}, "hidden_size must be an integer >= 1, not '576'"),
        ({**LLAMA, "hidden_size": 64.0}, "hidden_size must be an integer"),
        ({**LLAMA, "num_hidden_layers": True}, "num_hidden_layers must be an integer"),
        ({**LLAMA, "num_attention_heads": 0}, "num_attention_heads must be an integer >= 1"),
        ({**LLAMA, "vocab_size": None}, "vocab_size is missing"),
        ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "intermediate_size is"),
        ({**LLAMA, "num_attention_heads": 5}, "not a multiple of num_attention_heads"),
        ({**LLAMA, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({**LLAMA, "rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
        ({**LLAMA, "rope_theta": "1e4"}, "rope_theta must be a positive number"),
        ({**LLAMA, "rope_scaling": "linear"}, "rope_parameters/rope_scaling must be an object"),
        ({**LLAMA, "rope_scaling": {"rope_type": "linear"}}, "'linear' needs factor"),
        ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8}}, "needs low_freq"),
        ({**LLAMA, "rope_scaling": {"type": "longrope"}}, "'longrope' needs short_factor: 8 "),
        (
            {**LLAMA, "rope_scaling": {"type": "su"}},
            "'longrope' needs short_factor",
        ),  # (its old name)
        ({**LLAMA, "partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number in"),
        ({**LLAMA, "partial_rotary_factor": "3/4"}, "partial_rotary_factor must be a number in"),
        (
            {**LLAMA, "partial_rotary_factor": 0.5, "rope_scaling": {"type": "longrope"}},
            "'longrope' needs short_factor: 4 ",  # (factors for the rotated channels only)
        ),
        (
            {**LLAMA, "rope_scaling": {"type": "longrope", "short_factor": [1] * 8}},
            "needs long_factor",
        ),
        (
            {**LLAMA, "rope_scaling": {"type": "longrope", "short_factor": [1] * 7}},
            "needs short_factor: 8 positive",
        ),
        (
            {
                **LLAMA,
                "rope_scaling": {
                    "type": "longrope",
                    "short_factor": [1] * 8,
                    "long_factor": [0] * 8,
                },
            },
            "needs long_factor",
        ),
        ({**BASE, "model_type": "gemma2", "attn_logit_softcapping": "50"}, "attn_logit_soft"),
        ({**BASE, "model_type": "gemma2", "final_logit_softcapping": -1}, "final_logit_soft"),
        ({**LLAMA, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({**LLAMA, "eos_token_id": "</s>"}, "eos_token_id must be a token id"),
        ({**LLAMA, "eos_token_id": [2, -1]}, "eos_token_id must be a token id"),
        ({**LLAMA, "bos_token_id": 1.5}, "bos_token_id must be a token id"),
        ({**BASE, "model_type": "mistral", "sliding_window": "4k"}, "sliding_window must be"),
    ],
)
def test_damaged_config_names_the_key(hf, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config(hf)


def test_tied_embeddings_default_to_the_family_config_class():
    """Gemma's config.json files leave tie_word_embeddings out (transformers' Gemma2Config
    and Gemma3TextConfig default it to True; the checkpoints ship no lm_head); Llama's
    default is False; an explicit value wins."""
    for model_type, tied in (("gemma2", True), ("gemma3_text", True), ("llama", False)):
        assert (
            ModelConfig.from_hf_config({**BASE, "model_type": model_type}).tie_word_embeddings
            is tied
        )
    untied = {**BASE, "model_type": "gemma2", "tie_word_embeddings": False}
    assert not ModelConfig.from_hf_config(untied).tie_word_embeddings


def test_odd_head_dim_is_refused():
    with pytest.raises(UnsupportedModelError, match="odd head_dim"):
        ModelConfig.from_hf_config({**LLAMA, "head_dim": 15})


def test_config_errors_are_user_errors_naming_the_file(tmp_path):
    """weights.load_model turns a damaged config.json into one QspecError naming the file."""
    from qspec_core.errors import QspecError
    from qspec_core.model.checkpoint import load_model

    config = tmp_path / "config.json"
    for content, match in [
        (b"[]", "expected a JSON object"),
        (b"\xff\xfe{}", "not a readable JSON file"),
        (b'{"model_type": "llama", "hidden_size": "576"', "not a readable JSON file"),
    ]:
        config.write_bytes(content)
        with pytest.raises(QspecError, match=f"corrupt {config}: {match}"):
            load_model(tmp_path)


def test_rope_scaling_beside_rope_parameters_must_agree():
    """transformers 5's rope_parameters and 4's rope_scaling in one config.json: used where they
    agree on every key both give; refused, naming both, where they do not (neither wins)."""
    both = {**BASE, "model_type": "llama", "rope_theta": 5e5}
    agree = {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    assert ModelConfig.from_hf_config(both | agree).rope_type == "linear"
    differ = agree | {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    with pytest.raises(ConfigError, match="rope_parameters and rope_scaling disagree on factor"):
        ModelConfig.from_hf_config(both | differ)
    other_type = agree | {"rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with pytest.raises(ConfigError, match="disagree on rope_type .'linear' against 'dynamic'."):
        ModelConfig.from_hf_config(both | other_type)
    unset = agree | {"rope_scaling": None}  # (transformers 4's "no scaling")
    assert ModelConfig.from_hf_config(both | unset).rope_type == "linear"
