"""What a KV cache weighs, computed from the model's config alone (no cache allocated)."""

from __future__ import annotations

from qspec_core.config import ModelConfig

BF16_BYTES = 2


def full_kv_bytes(config: ModelConfig, tokens: int, element_bytes: int = BF16_BYTES) -> int:
    """Bytes of a full-precision K and V cache holding `tokens` positions: per position,
    every layer stores K and V, each [n_kv_heads, head_dim] of `element_bytes` (bf16: 2)."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * element_bytes * tokens
