"""Gemma 3 (text, model_type gemma3_text): sandwich norms scaling by 1 + weight, per-head q/k
norms, GELU (tanh), embeddings times sqrt(hidden_size), queries scaled by
query_pre_attn_scalar, and a plain local RoPE on the sliding-window layers. Tied head."""

from qspec_core.families.spec import Family, LayerSpec

FAMILY = Family(
    model_types=("gemma3_text",),
    label="Gemma 3 (text)",
    layer=LayerSpec(
        norm_placement="sandwich",
        norm="rms_plus_one",
        qk_norm="head",
        activation="gelu_pytorch_tanh",
        embed_scale=True,
        query_pre_attn_scalar=True,
        local_rope=True,
    ),
    reads_mlp_bias=False,
    ties_embeddings=True,
    sliding_window="layer_types",  # five local layers to one global (window_pattern 6)
)
