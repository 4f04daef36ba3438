"""Gemma 2 (model_type gemma2): Gemma 3's layer (`gemma3.py`: sandwich norms scaling by
1 + weight, GELU (tanh), embeddings times sqrt(hidden_size), the query scalar) without its q/k
norms and local RoPE, and with soft caps on the attention scores and on the logits
(cap * tanh(x / cap)). Tied head."""

from dataclasses import replace

from qspec_core.families.gemma3 import FAMILY as GEMMA3

FAMILY = replace(
    GEMMA3,
    model_types=("gemma2",),
    label="Gemma 2",
    layer=replace(GEMMA3.layer, qk_norm=None, local_rope=False, softcapping=True),
    window_pattern=2,  # every other layer slides (4,096 tokens), the others attend to all
)
