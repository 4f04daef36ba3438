"""`LayerSpec` (what one decoder layer computes) and `Family` (a family's config mapping)."""

from __future__ import annotations

from dataclasses import dataclass, field

NORMS = ("rms", "rms_fp32", "rms_plus_one")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # HF hidden_act / hidden_activation names
QK_NORMS = (None, "head", "all")
SLIDING_WINDOWS = ("none", "all", "qwen", "layer_types")


@dataclass(frozen=True)
class LayerSpec:
    """The parts of a decoder layer that differ between families (Llama's are the defaults).

    Every field is honoured by `model/transformer.py`; `native_ok()` says which of them the
    CPU runner's C++ kernels also compute.
    """

    # "pre": x + attn(norm(x)), then x + mlp(norm(x)) (Llama's input_layernorm and
    # post_attention_layernorm); "post": x + norm(attn(x)), then x + norm(mlp(x)) (OLMo 2's
    # post_attention_layernorm and post_feedforward_layernorm; no input norm); "sandwich":
    # both (Gemma 3: input_, post_attention_, pre_feedforward_, post_feedforward_layernorm)
    norm_placement: str = "pre"
    # RMSNorm (all in fp32 until the cast): "rms" (Llama: normalize, cast, scale by weight),
    # "rms_fp32" (OLMo 2: scale by weight, cast), "rms_plus_one" (Gemma: scale by 1 + weight,
    # cast); the same in fp32, not in bf16
    norm: str = "rms"
    # RMSNorm of q and k before RoPE: None; "head": over each head's head_dim channels
    # (Qwen3); "all": over the whole q or k projection (OLMo 2). Named q_norm / k_norm.
    qk_norm: str | None = None
    qkv_bias: bool = False  # q_proj, k_proj, v_proj biases
    o_bias: bool = False  # o_proj bias
    mlp_bias: bool = False  # gate_proj, up_proj, down_proj biases
    activation: str = "silu"  # of the gated MLP: down(act(gate(x)) * up(x)); ACTIVATIONS
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # queries scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma)
    query_pre_attn_scalar: bool = False
    # layers of layer_types "sliding_attention" rotate with their own plain RoPE of base
    # rope_local_base_freq (Gemma 3); the others with the model's
    local_rope: bool = False
    # reads attn_logit_softcapping (each scaled attention score s -> cap tanh(s / cap), before
    # the mask) and final_logit_softcapping (the logits alike) (Gemma 2); elsewhere refused
    softcapping: bool = False

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement must be one of {NORM_PLACEMENTS}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}")

    def native_ok(self) -> bool:
        """Whether the CPU runner's one-call C++ step (`runner/cpu_stack.py`, `step.cpp`)
        computes this layer: every field, the soft caps and sliding windows through the
        cache's attention (the hierarchical cache's `HierStep` and the full-precision cache's
        `FullStep` both apply them)."""
        return True


@dataclass(frozen=True)
class Family:
    """One model family: its HF `model_type`s and how their config keys map onto the layer.

    The layer is `layer` with the biases the config switches on: HF `attention_bias` (q, k,
    v and o) where `reads_attention_bias`, HF `mlp_bias` where `reads_mlp_bias`.
    """

    model_types: tuple[str, ...]
    label: str  # the family's models, for messages: "Llama 2/3.x, SmolLM2"
    layer: LayerSpec = field(default_factory=LayerSpec)
    reads_attention_bias: bool = True
    reads_mlp_bias: bool = True
    # how `sliding_window` applies: "none" (ignored: full attention), "all" (every layer,
    # Mistral), "qwen" (only with use_sliding_window, on layers >= max_window_layers),
    # "layer_types" (the layers config.json's layer_types names "sliding_attention"; without
    # the list, all but every `window_pattern`-th layer: Gemma 2/3)
    sliding_window: str = "none"
    window_pattern: int = 6  # ("layer_types": transformers 4's sliding_window_pattern default)
    # checkpoint modules that hold several of the model's linears stacked by output rows, split
    # at load in the parts' sizes: ("self_attn.qkv_proj", ("self_attn.q_proj", ...)) (Phi-3)
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # tie_word_embeddings where config.json leaves it out: transformers' default for the
    # family's config class (True for Gemma's, whose checkpoints ship no lm_head)
    ties_embeddings: bool = False

    def __post_init__(self):
        if self.sliding_window not in SLIDING_WINDOWS:
            raise ValueError(f"sliding_window must be one of {SLIDING_WINDOWS}")
