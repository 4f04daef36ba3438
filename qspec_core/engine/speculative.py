"""Self-speculative decoding (QuantSpec): draft with 4-bit weights over the INT4 KV view,
verify with full-precision weights over the INT8 view, one hierarchical cache for both.

One round, with the pending token t (sampled, not yet fed) at position c = committed length:
  1. (the cache rotates F1 into the planes by itself when a write's tokens all see it as
     history; every token's KV view depends only on its position, see `cache/hierarchical.py`)
  2. draft: feed t, g_1, ..., g_{gamma-1} one by one on the draft path, sampling g_i ~ q_i;
  3. verify: feed [t, g_1..g_gamma] at once on the target path -> p_1..p_{gamma+1}; this
     writes target KV over every draft position;
  4. accept (`verify.py`): n accepted drafts + one recovered or bonus token;
  5. rollback: truncate the cache to c + 1 + n and commit it: t and g_1..g_n now hold
     target-path KV, the rejected tail is gone. The new pending token is the recovered/bonus.
Greedy output is token-for-token that of autoregressive decoding on the target path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.sampling import SamplingParams, probabilities, sample
from qspec_core.engine.verify import verify_greedy, verify_sampling
from qspec_core.model.transformer import Transformer
from qspec_core.precision import DRAFT, TARGET, Precision
from qspec_core.timing import StageTimer

GAMMA_MAX = 16


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    accepted_hist: list[int] = field(default_factory=lambda: [0] * (GAMMA_MAX + 1))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        """Tokens emitted per verify forward (accepted + recovered + bonus) / rounds."""
        return (self.accepted + self.recovered + self.bonus) / self.rounds if self.rounds else 0.0

    def add(self, other: SpecStats) -> None:
        for name in ("rounds", "drafted", "accepted", "recovered", "bonus"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist = [
            a + b for a, b in zip(self.accepted_hist, other.accepted_hist, strict=True)
        ]

    def to_dict(self, gamma) -> dict:
        return {
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_step": round(self.tokens_per_target_step, 4),
            "gamma": gamma,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "recovered": self.recovered,
            "bonus": self.bonus,
            "accepted_hist": self.accepted_hist[: max(1, self._hist_len())],
        }

    def _hist_len(self) -> int:
        nonzero = [i for i, c in enumerate(self.accepted_hist) if c]
        return nonzero[-1] + 1 if nonzero else 0


class AdaptiveGamma:
    """gamma from recent acceptance: +1 after a round that accepted every draft, -1 after a
    round that accepted fewer than half, within [1, limit]. A cheap draft that keeps being
    right earns longer rounds; a wrong one stops wasting draft steps."""

    def __init__(self, start: int = 4, limit: int = GAMMA_MAX):
        self.gamma, self.limit = start, limit

    def update(self, n_accepted: int, gamma: int) -> None:
        if n_accepted == gamma:
            self.gamma = min(self.gamma + 1, self.limit)
        elif 2 * n_accepted < gamma:
            self.gamma = max(self.gamma - 1, 1)


def _move_rotation_time(cache, timer: StageTimer, stage: str, before: float) -> None:
    """Rotation happens inside the writes of `stage`: book it under its own stage."""
    spent = getattr(cache, "rotate_seconds", 0.0) - before
    if spent > 0:
        timer.seconds[stage] = timer.seconds.get(stage, 0.0) - spent
        timer.seconds["rotate"] = timer.seconds.get("rotate", 0.0) + spent


@torch.inference_mode()
def speculative_decode(
    model: Transformer,
    cache: HierarchicalKVCache | FullPrecisionCache,
    first_logits: torch.Tensor,
    start_pos: int,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    stop_ids: tuple[int, ...] = (),
    gamma: int | str = 4,
    timer: StageTimer | None = None,
    stats: SpecStats | None = None,
    verifier=None,
    draft_path: Precision = DRAFT,
    target_path: Precision = TARGET,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` ids following the target path's distribution.

    `first_logits` [V]: target logits for position `start_pos` (from the prefill); the cache
    holds positions < start_pos, all committed. `gamma`: drafts per round, or "auto".
    `verifier` overrides the acceptance step (tests force rejection patterns with it).
    `draft_path`/`target_path` pick the two paths (`qspec_core.precision`); the defaults are
    QuantSpec's. The bench's ablations use DRAFT_KV4 (full weights, INT4 view) and, over a
    `FullPrecisionCache`, DRAFT_W4/FP (4-bit weights, full-precision KV: plain
    self-speculation); an INT8 verifier is TARGET.with_weights("int8").
    On any exit (limit, stop token, Ctrl-C, close) the cache is truncated to the committed
    length: exactly the KV of the tokens fed so far, none of a half-finished round.
    """
    timer = timer or StageTimer()
    stats = stats if stats is not None else SpecStats()
    # a verify feeds gamma + 1 tokens, which must fit the hierarchical cache's slack of G
    limit = min(GAMMA_MAX, getattr(cache, "group_size", GAMMA_MAX + 1) - 1)
    adaptive = AdaptiveGamma(min(4, limit) if gamma == "auto" else int(gamma), limit=limit)
    if gamma != "auto" and not 1 <= int(gamma) <= limit:
        raise ValueError(f"gamma must be in 1..{limit}")
    device = model.device

    def feed(tokens: list[int], pos: int, path: Precision) -> torch.Tensor:
        ids = torch.tensor([tokens], device=device)
        return model(ids, torch.arange(pos, pos + len(tokens), device=device), cache, path)[0]

    with timer.stage("accept"):
        pending = int(sample(first_logits[None], params, generator)[0])
    emitted = 1
    committed = start_pos
    try:
        yield pending
        if pending in stop_ids:
            return
        while emitted < max_new_tokens:
            g = min(adaptive.gamma, max_new_tokens - emitted)  # never draft past the limit
            rotated = getattr(cache, "rotate_seconds", 0.0)
            drafts: list[int] = []
            draft_probs = []
            with timer.stage("draft"):
                token = pending
                for i in range(g):
                    logits = feed([token], committed + i, draft_path)[-1]
                    if params.greedy:
                        token = int(logits.argmax())
                    else:
                        q = probabilities(logits, params)
                        token = int(torch.multinomial(q, 1, generator=generator))
                        draft_probs.append(q)
                    drafts.append(token)
            _move_rotation_time(cache, timer, "draft", rotated)
            rotated = getattr(cache, "rotate_seconds", 0.0)
            with timer.stage("verify"):
                target_logits = feed([pending] + drafts, committed, target_path)  # [g + 1, V]
            _move_rotation_time(cache, timer, "verify", rotated)
            with timer.stage("accept"):
                draft_t = torch.tensor(drafts, device=device)
                if verifier is not None:
                    n, nxt = verifier(draft_t, target_logits)
                elif params.greedy:
                    n, nxt = verify_greedy(draft_t, target_logits)
                else:
                    n, nxt = verify_sampling(
                        draft_t,
                        torch.stack(draft_probs),
                        probabilities(target_logits, params),
                        generator,
                    )
            with timer.stage("rollback"):
                base = committed
                committed = base + 1 + n
                cache.truncate(committed)
                cache.commit(committed)
            stats.rounds += 1
            stats.drafted += g
            stats.accepted += n
            stats.accepted_hist[n] += 1
            if n < g:
                stats.recovered += 1
            else:
                stats.bonus += 1
            if gamma == "auto":
                adaptive.update(n, g)
            for j, token in enumerate(drafts[:n] + [nxt]):
                yield token
                emitted += 1
                if token in stop_ids or emitted >= max_new_tokens:
                    # as in autoregressive decoding, the last emitted token is not in the
                    # cache: keep t, g_1..g_j (positions < base + 1 + j)
                    committed = base + 1 + j
                    return
            pending = nxt
    finally:
        cache.truncate(committed)  # drop a half-finished round's KV (a no-op otherwise)
        cache.commit(committed)
