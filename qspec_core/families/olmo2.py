"""OLMo 2: norms after the attention and the MLP (not before), and an RMSNorm over the whole q
and k projections before RoPE."""

from qspec_core.families.spec import Family, LayerSpec

FAMILY = Family(
    model_types=("olmo2",),
    label="OLMo 2",
    layer=LayerSpec(norm="rms_fp32", norm_placement="post", qk_norm="all"),
    reads_mlp_bias=False,  # (Olmo2MLP has no biases)
)
