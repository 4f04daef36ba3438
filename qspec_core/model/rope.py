"""Rotary position embeddings with the scaling types Llama-family checkpoints ship.

Frequencies follow the formulas of the RoPE-scaling papers as Hugging Face parametrizes them
(`rope_parameters`), so logits match transformers on the same config.
"""

from __future__ import annotations

import math

import torch

from qspec_core.config import ModelConfig


def inv_frequencies(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotated // 2] (fp32) and the cos/sin scale for `config` (its
    rotated channels: all, or a partial rotary's first ones).

    `seq_len` matters for dynamic NTK scaling, whose base grows with the sequence, and for
    LongRoPE, whose long factors apply past original_max_position_embeddings.
    """
    dim = config.rotated
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
    if rope_type == "longrope":
        return _longrope(config, params, seq_len)
    return inv_freq, 1.0


def _longrope(config: ModelConfig, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    # Phi-3.5 / Phi-4-mini: per-frequency divisors, the long set for sequences longer than the
    # pretraining context; cos and sin scaled by sqrt(1 + ln(factor) / ln(original length)).
    dim, base = config.rotated, config.rope_theta
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_len))
    long = seq_len is not None and seq_len > original_len
    divisors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (divisors * base**exponents), float(attention_factor)


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
    dim, base = config.rotated, config.rope_theta
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
    """cos/sin for arbitrary positions; the model rotates q and k with `apply_rotary`.

    LongRoPE (Phi-3.5) picks its short or long factors once per sequence, by the capacity of
    the sequence's cache (`capacity`: its max_seq_len): long when it holds more positions than
    original_max_position_embeddings. Keys are cached rotated, so one set must serve the whole
    sequence for a verify to equal the steps it replaces and a chunked prefill to equal one
    forward. transformers picks per forward, by the forward's last position: the two agree
    while a sequence fits a cache of at most the original length, and when the prompt alone
    passes it (a chat plans for the whole context, so on Phi-3.5 it is long from the start).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # On the CPU even inside a meta skeleton (`build_model`, which then builds them again on
        # its device): torch computes some meta ops in Python, importing torch._dynamo and
        # Triton with it (150 MB resident on a CPU run).
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = inv_frequencies(config)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            if config.rope_type == "longrope":
                long = config.rope_scaling["original_max_position_embeddings"] + 1
                self.register_buffer("long_inv_freq", inv_frequencies(config, long)[0], False)

    def forward(
        self, input_pos: torch.Tensor, dtype: torch.dtype, capacity: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """input_pos [T] -> (cos, sin), each [T, rotated] in `dtype`, for a sequence whose
        cache holds `capacity` positions (LongRoPE's choice; None: the short factors)."""
        inv_freq = self.inv_freq
        if self.config.rope_type == "longrope":
            original = self.config.rope_scaling["original_max_position_embeddings"]
            if capacity is not None and capacity > original:
                inv_freq = self.long_inv_freq
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
    """x [B, H, T, D] rotated by cos/sin [T, r] (HF's rotate-half convention) in its first r
    channels; a partial rotary (r < D) passes the others through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
