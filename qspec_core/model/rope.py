"""Rotary position embeddings with the scaling types Llama-family checkpoints ship.

Frequencies follow the formulas of the RoPE-scaling papers as Hugging Face parametrizes them
(`rope_parameters`), so logits match transformers on the same config.
"""

from __future__ import annotations

import math

import torch

from qspec_core.config import ModelConfig


def inv_frequencies(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32) and the cos/sin scale for `config`.

    `seq_len` only matters for dynamic NTK scaling, whose base grows with the sequence.
    """
    dim = config.head_dim
    base = config.rope_theta
    params = config.rope_scaling
    rope_type = config.rope_type
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    if rope_type == "dynamic":
        max_pos = config.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = params["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)

    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(config, params)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between is blended.
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(config: ModelConfig, params: dict) -> tuple[torch.Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if m and m_all:
            attention_factor = mscale(factor, m) / mscale(factor, m_all)
        else:
            attention_factor = mscale(factor)

    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(n_rotations: float) -> float:
        # dimension index whose wavelength fits n_rotations times into the original context
        return dim * math.log(original_len / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin for arbitrary positions; the model rotates q and k with `apply_rotary`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = inv_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """input_pos [T] -> (cos, sin), each [T, head_dim] in `dtype`."""
        inv_freq = self.inv_freq
        if self.config.rope_type == "dynamic":
            seq_len = int(input_pos.max()) + 1
            if seq_len > self.config.max_position_embeddings:
                inv_freq, _ = inv_frequencies(self.config, seq_len)
        freqs = input_pos.float()[:, None] * inv_freq[None, :]  # [T, D/2], fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by cos/sin [T, D] (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
