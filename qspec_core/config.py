"""One config dataclass for every supported model, built from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from qspec_core.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters under their Hugging Face names (see `from_hf_config`)."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_parameters` minus `rope_theta`: {"rope_type": ..., "factor": ..., ...}
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    attention_bias: bool = False  # q/k/v/o biases (Llama's `attention_bias`)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # None: full attention at every length
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def context_limit(self) -> int:
        """Longest sequence this model can attend over correctly.

        With a sliding window, attention over at most `sliding_window` tokens is the same as
        full attention, so we run such models up to the window and refuse longer inputs.
        """
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelConfig:
        """Build from a parsed `config.json`; unknown keys are ignored, unsupported ones refused."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; qspec runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2)"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rope = _rope_parameters(hf)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        sliding_window = _sliding_window(model_type, hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.pop("rope_theta")),
            rope_scaling=rope,
            attention_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
            qkv_bias=model_type == "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_config(json.loads(Path(path).read_text()))


def _rope_parameters(hf: dict) -> dict:
    """Normalize transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "rope_type" not in rope:  # transformers 4 wrote "type"
        rope["rope_type"] = rope.pop("type", "default")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if rope["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {rope['rope_type']!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    if rope["rope_type"] in ("yarn", "llama3"):
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return rope


def _sliding_window(model_type: str, hf: dict) -> int | None:
    if model_type == "llama":
        return None
    if model_type == "qwen2":
        # Qwen2 applies the window only to layers >= max_window_layers, and only when enabled.
        if not hf.get("use_sliding_window", False):
            return None
        if hf.get("max_window_layers", hf["num_hidden_layers"]) >= hf["num_hidden_layers"]:
            return None
    window = hf.get("sliding_window")
    return int(window) if window else None
