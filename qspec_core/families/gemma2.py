"""Gemma 2 (model_type gemma2): Gemma 3's sandwich norms scaling by 1 + weight, GELU (tanh),
embeddings times sqrt(hidden_size) and query scalar, without q/k norms or a local RoPE, and with
soft caps on the attention scores and on the logits (cap * tanh(x / cap)). Tied head."""

from qspec_core.families.spec import Family, LayerSpec

FAMILY = Family(
    model_types=("gemma2",),
    label="Gemma 2",
    layer=LayerSpec(
        norm_placement="sandwich",
        norm="rms_plus_one",
        activation="gelu_pytorch_tanh",
        embed_scale=True,
        query_pre_attn_scalar=True,
        softcapping=True,
    ),
    reads_mlp_bias=False,
    # every other layer slides (4096 tokens), the others attend to all: with the context capped
    # at the window (ModelConfig.context_limit) both kinds attend to every key
    sliding_window="all",
)
