"""Phi-3 / 3.5 / Phi-4 (model_type phi3): Llama's layer, with q/k/v and gate/up fused into one
linear each in the checkpoint (split at load) and a sliding window on every layer. Phi-3.5's
"longrope" RoPE and Phi-4-mini's partial rotary are `model/rope.py`'s (the C++ step rotates
the cos/sin it is given: a partial rotary's first channels)."""

from qspec_core.families.spec import Family

FAMILY = Family(
    model_types=("phi3",),
    label="Phi-3/Phi-4",
    sliding_window="all",
    fused=(
        ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ),
)
