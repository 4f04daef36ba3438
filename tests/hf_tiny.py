"""Tiny random Hugging Face models and their qspec twins, for parity tests."""

import torch
import transformers
from conftest import TINY_SHAPE

from qspec_core.config import ModelConfig
from qspec_core.model.checkpoint import build_model


def tiny_hf(model_type: str, seed: int = 0, **overrides):
    kwargs = dict(TINY_SHAPE, vocab_size=101, num_key_value_heads=2, max_position_embeddings=64)
    kwargs["tie_word_embeddings"] = False
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missing term shows
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(std=0.15)
            else:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    return model


def ours_from_hf(hf_model, dtype=torch.float32):
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    return build_model(config, state, dtype=dtype)
