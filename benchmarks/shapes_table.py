"""The shapes `shapes.py` writes: each named model's config and tensor list, and the
constants of its files (seed, block and shard sizes)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from qspec_core.config import ModelConfig

SEED = 20250101
STD = 0.02  # the configs' initializer_range
SHARD_BYTES = 4 * 10**9  # a safetensors shard closes before it would pass this ("4GB")
BLOCK_VALUES = 1 << 24  # generated at once: 64 MiB as float32, 32 MiB as bf16
# Blocks start at multiples of this many rows: whole heads (head_dim divides it), so the
# GGUF's per-head row reordering works block by block.
ROW_GRANULE = 256
DEFAULT_OUT = Path(__file__).resolve().parent / "models"
GGUF_TYPES = {
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GB = 10**9
GGUF_ARCHS = ("llama", "qwen2")  # the families whose GGUF layout `tensors` writes


class UsageError(Exception):
    """Bad input or a missing prerequisite: one `error:` line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# The shapes


@dataclass(frozen=True)
class Shape:
    name: str
    mirrors: str  # the Hugging Face model whose config.json `config` is
    config: dict

    @property
    def arch(self) -> str:
        return self.config["model_type"]  # "llama", "qwen2": llama.cpp's names too; or "qwen3"...

    @property
    def gguf(self) -> bool:
        """Whether a GGUF of the shape can be written (llama.cpp's tensor names are known)."""
        return self.arch in GGUF_ARCHS


_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "use_cache": True,
    "vocab_size": 128256,
}


def _llama3_rope(factor: float) -> dict:
    # 3.1 and 3.2 stretch Llama 3's 8k pretraining context to 128k: wavelengths longer than
    # 8192 / low_freq_factor divided by `factor`, shorter than 8192 / high_freq_factor kept
    return {
        "factor": factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "use_cache": True,
    "use_sliding_window": False,  # (so sliding_window and max_window_layers change nothing)
}


# Phi-4-mini's LongRoPE factors past its 4k original context (one per rotated frequency pair:
# 96 of the 128 channels rotate), as its config.json has them
_PHI4_MINI_LONG_FACTOR = [
    1.0,
    1.118320672,
    1.250641126,
    1.398617824,
    1.564103225,
    1.74916897,
    1.956131817,
    2.187582649,
    2.446418898,
    2.735880826,
    3.059592084,
    3.421605075,
    3.826451687,
    4.279200023,
    4.785517845,
    5.351743533,
    5.984965424,
    6.693110555,
    7.485043894,
    8.370679318,
    9.36110372,
    10.4687158,
    11.70738129,
    13.09260651,
    14.64173252,
    16.37415215,
    18.31155283,
    20.47818807,
    22.90118105,
    25.61086418,
    28.64115884,
    32.03,
    32.1,
    32.13,
    32.23,
    32.6,
    32.61,
    32.64,
    32.66,
    32.7,
    32.71,
    32.93,
    32.97,
    33.28,
    33.49,
    33.5,
    44.16,
    47.77,
]


def _with_llama_twin(shape: Shape) -> tuple[Shape, Shape]:
    """`shape` and a Llama with its matrices (widths, heads, layers, vocabulary, tying, RoPE
    base): the same weight bytes through Llama's plain layer, which the C++ stack runs."""
    c = shape.config
    same = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
        "tie_word_embeddings", "vocab_size",
    )  # fmt: skip
    twin = {**_LLAMA3, **{k: c[k] for k in same}, "rms_norm_eps": c["rms_norm_eps"]}
    return shape, Shape(f"llama-as-{shape.name}", f"Llama layers, {shape.mirrors}'s shapes", twin)


SHAPES = {
    shape.name: shape
    for shape in (
        Shape(
            "llama-3.2-1b",
            "meta-llama/Llama-3.2-1B-Instruct",
            {
                **_LLAMA3,
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "rope_scaling": _llama3_rope(32.0),
                "tie_word_embeddings": True,
            },
        ),
        Shape(
            "llama-3.2-3b",
            "meta-llama/Llama-3.2-3B-Instruct",
            {
                **_LLAMA3,
                "hidden_size": 3072,
                "intermediate_size": 8192,
                "num_hidden_layers": 28,
                "num_attention_heads": 24,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "rope_scaling": _llama3_rope(32.0),
                "tie_word_embeddings": True,
            },
        ),
        Shape(
            "llama-3.1-8b",
            "meta-llama/Llama-3.1-8B-Instruct",
            {
                **_LLAMA3,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "rope_scaling": _llama3_rope(8.0),
                "tie_word_embeddings": False,
            },
        ),
        Shape(
            "qwen2.5-0.5b",
            "Qwen/Qwen2.5-0.5B-Instruct",
            {
                **_QWEN25,
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "max_position_embeddings": 32768,
                "sliding_window": 32768,
                "max_window_layers": 21,
                "tie_word_embeddings": True,
                "vocab_size": 151936,
            },
        ),
        Shape(
            "qwen2.5-7b",
            "Qwen/Qwen2.5-7B-Instruct",
            {
                **_QWEN25,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "max_position_embeddings": 32768,
                "sliding_window": 131072,
                "max_window_layers": 28,
                "tie_word_embeddings": False,
                "vocab_size": 152064,
            },
        ),
        # Issue 54's families (no GGUF: qspec bench only), each beside a Llama of the same
        # matrices (`_llama_as`): what their layers' extra operations cost
        *_with_llama_twin(
            Shape(
                "qwen3-0.6b",
                "Qwen/Qwen3-0.6B",
                {
                    "architectures": ["Qwen3ForCausalLM"],
                    "model_type": "qwen3",
                    "attention_bias": False,
                    "hidden_act": "silu",
                    "initializer_range": 0.02,
                    "hidden_size": 1024,
                    "intermediate_size": 3072,
                    "num_hidden_layers": 28,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "max_position_embeddings": 40960,
                    "max_window_layers": 28,
                    "rms_norm_eps": 1e-06,
                    "rope_theta": 1000000.0,
                    "sliding_window": None,
                    "use_sliding_window": False,
                    "tie_word_embeddings": True,
                    "vocab_size": 151936,
                },
            )
        ),
        *_with_llama_twin(
            Shape(
                "gemma-3-1b",
                "google/gemma-3-1b-it",
                {
                    "architectures": ["Gemma3ForCausalLM"],
                    "model_type": "gemma3_text",
                    "attention_bias": False,
                    "attn_logit_softcapping": None,
                    "final_logit_softcapping": None,
                    "hidden_activation": "gelu_pytorch_tanh",
                    "initializer_range": 0.02,
                    "hidden_size": 1152,
                    "intermediate_size": 6912,
                    "num_hidden_layers": 26,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 1,
                    "head_dim": 256,
                    "max_position_embeddings": 32768,
                    "query_pre_attn_scalar": 256,
                    "rms_norm_eps": 1e-06,
                    "rope_local_base_freq": 10000.0,
                    "rope_scaling": None,
                    "rope_theta": 1000000.0,
                    "sliding_window": 512,
                    "sliding_window_pattern": 6,
                    "tie_word_embeddings": True,
                    "vocab_size": 262144,
                },
            )
        ),
        *_with_llama_twin(
            Shape(
                "gemma-2-2b",
                "google/gemma-2-2b-it",
                {
                    "architectures": ["Gemma2ForCausalLM"],
                    "model_type": "gemma2",
                    "attention_bias": False,
                    "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0,
                    "hidden_activation": "gelu_pytorch_tanh",
                    "initializer_range": 0.02,
                    "hidden_size": 2304,
                    "intermediate_size": 9216,
                    "num_hidden_layers": 26,
                    "num_attention_heads": 8,
                    "num_key_value_heads": 4,
                    "head_dim": 256,
                    "max_position_embeddings": 8192,
                    "query_pre_attn_scalar": 256,
                    "rms_norm_eps": 1e-06,
                    "rope_theta": 10000.0,
                    "sliding_window": 4096,
                    "tie_word_embeddings": True,
                    "vocab_size": 256000,
                },
            )
        ),
        *_with_llama_twin(
            Shape(
                "olmo-2-1b",
                "allenai/OLMo-2-0425-1B-Instruct",
                {
                    "architectures": ["Olmo2ForCausalLM"],
                    "model_type": "olmo2",
                    "attention_bias": False,
                    "hidden_act": "silu",
                    "initializer_range": 0.02,
                    "hidden_size": 2048,
                    "intermediate_size": 8192,
                    "num_hidden_layers": 16,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 16,
                    "head_dim": 128,
                    "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-06,
                    "rope_theta": 500000.0,
                    "tie_word_embeddings": False,
                    "vocab_size": 100352,
                },
            )
        ),
        *_with_llama_twin(
            Shape(
                "phi-4-mini",
                "microsoft/Phi-4-mini-instruct",
                {
                    "architectures": ["Phi3ForCausalLM"],
                    "model_type": "phi3",
                    "attention_bias": False,
                    "hidden_act": "silu",
                    "initializer_range": 0.02,
                    "hidden_size": 3072,
                    "intermediate_size": 8192,
                    "num_hidden_layers": 32,
                    "num_attention_heads": 24,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "max_position_embeddings": 131072,
                    "original_max_position_embeddings": 4096,
                    "partial_rotary_factor": 0.75,
                    "rms_norm_eps": 1e-05,
                    "rope_scaling": {
                        "type": "longrope",
                        "long_factor": _PHI4_MINI_LONG_FACTOR,
                        "short_factor": [1.0] * 48,
                    },
                    "rope_theta": 10000.0,
                    "sliding_window": 262144,
                    "tie_word_embeddings": True,
                    "vocab_size": 200064,
                },
            )
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# The tensors


@dataclass(frozen=True)
class Tensor:
    name: str  # Hugging Face's
    gguf_name: str  # llama.cpp's
    shape: tuple[int, ...]  # rows first (GGUF's tensor table lists columns first)
    ones: bool = False  # an RMSNorm weight: 1, as initialized
    # Llama's q/k: llama.cpp's converter reorders each head's rows (its head_dim), 0: not
    rope_head: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def gguf_type(self, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
        return qtype if len(self.shape) == 2 else GGMLQuantizationType.F32

    def gguf_bytes(self, qtype: GGMLQuantizationType) -> int:
        block, size = GGML_QUANT_SIZES[self.gguf_type(qtype)]
        return self.numel // block * size


def tensors(shape: Shape) -> list[Tensor]:
    """The checkpoint's tensors in writing order; a tied lm_head is not one (HF omits it)."""
    if not shape.gguf:
        return _tensors_of_qspec(shape)
    c = shape.config
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    rope_head = d if shape.arch == "llama" else 0  # qwen2: ggml's NeoX RoPE, rows as in HF
    out = [Tensor("model.embed_tokens.weight", "token_embd.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        out.append(Tensor(hf + "input_layernorm.weight", gg + "attn_norm.weight", (h,), True))
        for proj, rows, head in (("q", q, rope_head), ("k", kv, rope_head), ("v", kv, 0)):
            hf_proj, gg_proj = f"{hf}self_attn.{proj}_proj", f"{gg}attn_{proj}"
            out.append(Tensor(hf_proj + ".weight", gg_proj + ".weight", (rows, h), rope_head=head))
            if shape.arch == "qwen2":  # Qwen2's q/k/v biases
                out.append(Tensor(hf_proj + ".bias", gg_proj + ".bias", (rows,)))
        out += [
            Tensor(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (h, q)),
            Tensor(hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (h,), True),
            Tensor(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (f, h)),
            Tensor(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (f, h)),
            Tensor(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (h, f)),
        ]
    out.append(Tensor("model.norm.weight", "output_norm.weight", (h,), True))
    if not c["tie_word_embeddings"]:
        out.append(Tensor("lm_head.weight", "output.weight", (c["vocab_size"], h)))
    return out


def _qspec_parameters(shape: Shape) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """The config as qspec reads it, and the parameters of the Transformer qspec builds from
    it (on the meta device: no memory), in its order, by Hugging Face's names; a tied lm_head
    is not one (HF omits it)."""
    from qspec_core.model.transformer import Transformer

    config = ModelConfig.from_hf_config(hf_config(shape, {}))
    with torch.device("meta"):
        model = Transformer(config)
    params = {
        (k if k == "lm_head.weight" else "model." + k): tuple(v.shape)
        for k, v in model.state_dict().items()
        if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    return config, params


def _tensors_of_qspec(shape: Shape) -> list[Tensor]:
    """A family without a GGUF layout here: qspec's parameters for its config, with no GGUF
    names. Norm weights are 1, except where the family scales by 1 + weight (Gemma): there
    N(0, 0.02), a scale of about 1 too."""
    config, params = _qspec_parameters(shape)
    unit = config.layer.norm != "rms_plus_one"
    return [
        Tensor(name, "", dims, ones=unit and name.endswith("norm.weight"))
        for name, dims in params.items()
    ]


def rope_freq_factors(config: dict) -> np.ndarray | None:
    """Llama 3.x's RoPE scaling as llama.cpp takes it, `rope_freqs.weight` [head_dim / 2]:
    per frequency, the divisor of the unscaled one (1 for short wavelengths, `factor` for long
    ones, blended between; the frequencies of qspec_core/model/rope.py's _llama3). None when
    the RoPE is not scaled."""
    rope = config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") == "default":
        return None
    if rope["rope_type"] != "llama3":
        raise NotImplementedError(f"RoPE scaling {rope['rope_type']!r} in a GGUF")
    d = config["head_dim"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi * config["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return factors.astype(np.float32)


def hf_config(shape: Shape, token_ids: dict) -> dict:
    return dict(sorted({**shape.config, **token_ids, "torch_dtype": "bfloat16"}.items()))


def check_with_qspec(shape: Shape, planned: list[Tensor]) -> ModelConfig:
    """Read the config as qspec does and compare the planned tensors with the parameters of the
    Transformer qspec builds from it (on the meta device: no memory), as its loader will."""
    config, want = _qspec_parameters(shape)
    have = {t.name: t.shape for t in planned}
    if want != have:
        odd = sorted(set(want.items()) ^ set(have.items()))[:4]
        raise AssertionError(f"{shape.name}: qspec expects other tensors ({odd})")
    if shape.arch == "llama" and ROW_GRANULE % config.head_dim:
        raise AssertionError(f"{shape.name}: head_dim must divide {ROW_GRANULE}")
    return config


# ---------------------------------------------------------------------------------------------
# The values
