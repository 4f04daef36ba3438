"""Logits -> token: temperature, top-k, top-p, with an explicit `torch.Generator`.

The engine's draws are keyed by position (`draw`): the token at absolute position i is
argmax(p / E) with E ~ Exp(1) per vocabulary entry drawn from (seed, i, purpose) alone, an
exact sample of p (the exponential race, the Gumbel-max trick's form). The draft and the target
read the same E at a position, so a draft that agrees with the target is accepted, and the
text never depends on how the tokens were grouped into rounds (gamma, the draft source): a
seed gives target-ar's very tokens.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

# Below this, logits / T leaves fp32's range (1e-45 gives inf - inf = nan probabilities), and
# long before that sampling is greedy in all but name: temperature 0 says so exactly.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy, else >= MIN_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit

    def __post_init__(self):
        t = self.temperature
        if not math.isfinite(t) or (t != 0 and t < MIN_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, not {t}"
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), not {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the sampling distribution [..., V] (fp32) after temperature/top-k/top-p.

    The speculative verifier applies this same function to draft and target logits, so both
    distributions are filtered consistently.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generator_seed(generator: torch.Generator | None) -> int:
    """The seed of a run: its generator's (`--seed`), 0 without one."""
    return 0 if generator is None else generator.initial_seed()


def position_seed(seed: int, position: int, purpose: str = "token") -> int:
    """The 64-bit seed of one position's randomness for one purpose: a hash of the three, so
    neighbouring seeds and positions give unrelated streams."""
    digest = hashlib.sha256(f"{seed}:{position}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """probs [V] -> the token at `position`: argmax(probs / E), E [V] ~ Exp(1) drawn from
    (seed, position) alone (P(token = v) = probs[v]; a zero-probability token never wins)."""
    generator = torch.Generator(device=probs.device).manual_seed(position_seed(seed, position))
    race = torch.empty(probs.shape[-1], device=probs.device, dtype=torch.float32)
    race.exponential_(generator=generator)
    return int((probs.float() / race).argmax())


def sample_at(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """logits [V] -> the token at `position`: the argmax when greedy, else `draw`."""
    if params.greedy:
        return int(logits.argmax())
    return draw(probabilities(logits[None], params)[0], seed, position)
