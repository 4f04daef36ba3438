"""Self-speculative decoding (QuantSpec): draft with 4-bit weights over the INT4 KV view,
verify with full-precision weights over the INT8 view, one hierarchical cache for both.

One round, with the pending token t (sampled, not yet fed) at position c = committed length:
  1. (the cache rotates F1 into the planes by itself when a write's tokens all see it as
     history; every token's KV view depends only on its position, see `cache/hierarchical.py`)
  2. draft: feed t, g_1, ..., g_{gamma-1} one by one on the draft path, sampling g_i ~ q_i
     (or, when the context's last tokens occurred earlier in it, take the gamma tokens that
     followed them there: `lookup.py`, a point-mass q, no draft forward at all; with gamma
     "auto", `planner.py` picks the source and gamma, 0 included, by measured cost);
  3. verify: feed [t, g_1..g_gamma] at once on the target path -> p_1..p_{gamma+1}; this
     writes target KV over every draft position;
  4. accept (`verify.py`): n accepted drafts + one recovered or bonus token;
  5. rollback: truncate the cache to c + 1 + n and commit it: t and g_1..g_n now hold
     target-path KV, the rejected tail is gone. The new pending token is the recovered/bonus.
Greedy output is token-for-token that of autoregressive decoding on the target path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.planner import RoundPlanner
from qspec_core.engine.sampling import SamplingParams, probabilities, sample
from qspec_core.engine.verify import verify_greedy, verify_sampling
from qspec_core.model.transformer import Transformer
from qspec_core.precision import DRAFT, TARGET, Precision
from qspec_core.timing import StageTimer

GAMMA_MAX = 16


# SpecStats' counters (what `add` sums)
COUNTS = (
    ("rounds", "drafted", "accepted", "recovered", "bonus")
    + tuple(f"lookup_{name}" for name in ("rounds", "drafted", "accepted"))
    + ("plain_rounds",)
)


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    accepted_hist: list[int] = field(default_factory=lambda: [0] * (GAMMA_MAX + 1))
    # of the above, the rounds whose drafts came from the document (`lookup.py`)
    lookup_rounds: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    plain_rounds: int = 0  # rounds that drafted nothing (`--gamma auto`): plain target steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        """Tokens emitted per verify forward (accepted + recovered + bonus) / rounds."""
        return (self.accepted + self.recovered + self.bonus) / self.rounds if self.rounds else 0.0

    def add(self, other: SpecStats) -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist = [
            a + b for a, b in zip(self.accepted_hist, other.accepted_hist, strict=True)
        ]

    def count(self, source: str, g: int, n: int) -> None:
        """One round: g drafts from `source` ("draft" or "lookup"), n of them accepted."""
        self.rounds += 1
        self.drafted += g
        self.accepted += n
        self.accepted_hist[n] += 1
        if n < g:
            self.recovered += 1
        else:
            self.bonus += 1
        if source == "lookup":
            self.lookup_rounds += 1
            self.lookup_drafted += g
            self.lookup_accepted += n
        elif not g:
            self.plain_rounds += 1

    @classmethod
    def from_dict(cls, d: dict) -> SpecStats:
        """The inverse of `to_dict`."""
        sources = d["sources"]
        hist = d["accepted_hist"] + [0] * (GAMMA_MAX + 1 - len(d["accepted_hist"]))
        return cls(
            *(d[name] for name in COUNTS[:5]),
            hist,
            *(sources["lookup"][name] for name in ("rounds", "drafted", "accepted")),
            sources["none"]["rounds"],
        )

    def sources(self) -> dict:
        """Rounds, drafts and acceptance per draft source: the 4-bit path ("draft"), the
        document ("lookup") and none ("none": `--gamma auto` chose a plain target step)."""
        out = {}
        for name, rounds, drafted, accepted in (
            ("draft", self.rounds - self.lookup_rounds - self.plain_rounds, self.draft_steps,
             self.accepted - self.lookup_accepted),
            ("lookup", self.lookup_rounds, self.lookup_drafted, self.lookup_accepted),
            ("none", self.plain_rounds, 0, 0),
        ):  # fmt: skip
            rate = round(accepted / drafted, 4) if drafted else 0.0
            out[name] = {"rounds": rounds, "drafted": drafted, "accepted": accepted,
                         "acceptance_rate": rate}  # fmt: skip
        return out

    @property
    def draft_steps(self) -> int:
        """Forward passes on the draft path: drafts that did not come from the document."""
        return self.drafted - self.lookup_drafted

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
            "draft_steps": self.draft_steps,
            "sources": self.sources(),
        }

    def _hist_len(self) -> int:
        nonzero = [i for i, c in enumerate(self.accepted_hist) if c]
        return nonzero[-1] + 1 if nonzero else 0


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
    lookup: DocumentLookup | None = None,
    planner: RoundPlanner | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` ids following the target path's distribution.

    `first_logits` [V]: target logits for position `start_pos` (from the prefill); the cache
    holds positions < start_pos, all committed. `gamma`: drafts per round, or "auto".
    `verifier` overrides the acceptance step (tests force rejection patterns with it), and
    `planner` the choice of each round's drafts (with gamma "auto"; tests script it).
    `draft_path`/`target_path` pick the two paths (`qspec_core.precision`); the defaults are
    QuantSpec's. "auto" lets `planner.py` pick each round's source and length by measured
    cost. The bench's ablations use DRAFT_KV4 (full weights, INT4 view) and, over a
    `FullPrecisionCache`, DRAFT_W4/FP (4-bit weights, full-precision KV: plain
    self-speculation); an INT8 verifier is TARGET.with_weights("int8").
    `lookup`: an index over the prompt's ids (`DocumentLookup(prompt)`); each round first asks
    it for drafts, and the emitted tokens are appended to it. None: every draft is the model's.
    On any exit (limit, stop token, Ctrl-C, close) the cache is truncated to the committed
    length: exactly the KV of the tokens fed so far, none of a half-finished round.
    """
    timer = timer or StageTimer()
    stats = stats if stats is not None else SpecStats()
    # a verify feeds gamma + 1 tokens, which must fit the hierarchical cache's slack of G
    limit = min(GAMMA_MAX, getattr(cache, "group_size", GAMMA_MAX + 1) - 1)
    if gamma != "auto" and not 1 <= int(gamma) <= limit:
        raise ValueError(f"gamma must be in 1..{limit}")
    if gamma == "auto" and planner is None:
        planner = RoundPlanner(limit)
    device = model.device

    def feed(tokens: list[int], pos: int, path: Precision) -> torch.Tensor:
        ids = torch.tensor([tokens], device=device)
        return model(ids, torch.arange(pos, pos + len(tokens), device=device), cache, path)[0]

    def rotation() -> float:
        return getattr(cache, "rotate_seconds", 0.0)

    with timer.stage("accept"):
        pending = int(sample(first_logits[None], params, generator)[0])
    lookup_tail = [pending]  # emitted tokens the lookup index has not seen yet
    emitted = 1
    committed = start_pos
    vocab = first_logits.shape[-1]
    try:
        yield pending
        if pending in stop_ids:
            return
        while emitted < max_new_tokens:
            room = max_new_tokens - emitted  # (never draft past the limit)
            proposal: list[int] = []
            if lookup is not None:
                with timer.stage("lookup"):
                    lookup.extend(lookup_tail)
                    proposal = lookup.propose(min(limit if planner else int(gamma), room))
            if planner is not None:
                source, g = planner.plan(len(proposal))
                g = min(g, room)
            else:
                source, g = ("lookup", len(proposal)) if proposal else ("draft", min(gamma, room))
            drafts: list[int] = []
            draft_probs = []
            rotated, started = rotation(), time.perf_counter()
            if source == "lookup":
                drafts = proposal[:g]
                if not params.greedy:  # q: a point mass on each proposed token
                    point = torch.zeros(g, vocab, device=device)
                    point[torch.arange(g), torch.tensor(drafts)] = 1.0
                    draft_probs = list(point)
            elif g:
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
            draft_s = time.perf_counter() - started - (rotation() - rotated)
            rotated, started = rotation(), time.perf_counter()
            with timer.stage("verify"):
                target_logits = feed([pending] + drafts, committed, target_path)  # [g + 1, V]
            _move_rotation_time(cache, timer, "verify", rotated)
            with timer.stage("accept"):
                draft_t = torch.tensor(drafts, device=device, dtype=torch.long)
                if verifier is not None:
                    n, nxt = verifier(draft_t, target_logits)
                elif params.greedy:
                    n, nxt = verify_greedy(draft_t, target_logits)
                elif not drafts:  # a plain target step
                    n, nxt = 0, int(sample(target_logits[-1:], params, generator)[0])
                else:
                    n, nxt = verify_sampling(
                        draft_t,
                        torch.stack(draft_probs),
                        probabilities(target_logits, params),
                        generator,
                    )
            # (the accept stage ends the verify on a GPU: its first read of the logits waits)
            verify_s = time.perf_counter() - started - (rotation() - rotated)
            with timer.stage("rollback"):
                base = committed
                committed = base + 1 + n
                cache.truncate(committed)
                cache.commit(committed)
            stats.count(source, g, n)
            if planner is not None:
                planner.record(source, g, n, draft_s, verify_s)
            lookup_tail = drafts[:n] + [nxt]
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
