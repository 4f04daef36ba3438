"""Qwen3 (dense): Llama's layer with an RMSNorm over each head of q and k before RoPE."""

from qspec_core.families.spec import Family, LayerSpec

FAMILY = Family(
    model_types=("qwen3",),
    label="Qwen3",
    layer=LayerSpec(qk_norm="head"),
    sliding_window="qwen",
)
