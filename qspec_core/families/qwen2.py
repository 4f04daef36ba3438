"""Qwen2 / Qwen2.5: Llama's layer with q/k/v biases (and no o_proj bias)."""

from qspec_core.families.spec import Family, LayerSpec

FAMILY = Family(
    model_types=("qwen2",),
    label="Qwen2/2.5",
    layer=LayerSpec(qkv_bias=True),
    reads_attention_bias=False,  # Qwen2's biases are fixed, whatever attention_bias says
    sliding_window="qwen",
)
