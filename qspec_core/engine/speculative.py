"""Self-speculative decoding (QuantSpec): draft with 4-bit weights over the INT4 KV view,
verify with full-precision weights over the INT8 view, one hierarchical cache for both.

One round, with the pending token t (sampled, not yet fed) at position c = committed length:
  1. (the cache rotates F1 into the planes by itself when a write's tokens all see it as
     history; every token's KV view depends only on its position, see `cache/hierarchical.py`)
  2. draft: one proposer (`proposers.py`) drafts g_1..g_gamma with their q: the 4-bit path
     feeds t, g_1, ..., g_{gamma-1} one by one, sampling g_i ~ q_i; the document lookup
     takes the gamma tokens that followed the context's last tokens earlier in it
     (`lookup.py`, a point-mass q, no draft forward at all). A fixed gamma takes the first
     proposer that offers tokens; with gamma "auto", `planner.py` picks the proposer and
     gamma, 0 included, by measured cost. Every proposer then observes the emitted tokens;
  3. verify: feed [t, g_1..g_gamma] at once on the target path -> p_1..p_{gamma+1}; this
     writes target KV over every draft position;
  4. accept (`verify.py`): n accepted drafts + one recovered or bonus token;
  5. rollback: truncate the cache to c + 1 + n and commit it: t and g_1..g_n now hold
     target-path KV, the rejected tail is gone. The new pending token is the recovered/bonus.
A round may instead verify a token tree (`tree.py`: several continuations at once, each node
seeing its ancestors only); the verifier walks down it, and the rollback first moves the
accepted path's KV to where a chain's would be (`keep_rows`).
Greedy output is token-for-token that of autoregressive decoding on the target path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kernels import MAX_DRAFTS
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.config import check_gamma, gamma_limit
from qspec_core.engine.draft_vocab import DraftVocab
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.planner import RoundPlanner
from qspec_core.engine.proposers import (
    DocumentDraft,
    DocumentTree,
    DraftSource,
    Proposer,
    RoundContext,
    SelfDraft,
    forward,
    move_rotation_time,
)
from qspec_core.engine.sampling import (
    SamplingParams,
    draw,
    generator_seed,
    probabilities,
    sample_at,
)
from qspec_core.engine.tree import DraftTree
from qspec_core.engine.verify import (
    verify_drawn,
    verify_greedy,
    verify_tree_drawn,
    verify_tree_greedy,
)
from qspec_core.precision import DRAFT, TARGET, Precision
from qspec_core.runner import Runner
from qspec_core.timing import StageTimer, StepCosts

# SpecStats' totals (what `add` sums besides the histogram and the sources)
COUNTS = ("rounds", "drafted", "accepted", "recovered", "bonus")
# the sources every stats dict lists, used or not: the 4-bit path, the document, and none
# (`--gamma auto` chose a plain target step); any other (the document's trees, another
# proposer) adds its own entry once it drafts a round
LISTED = (DraftSource.DRAFT, DraftSource.LOOKUP, DraftSource.NONE)


@dataclass
class SourceStats:
    """One draft source's rounds, drafted tokens and accepted ones."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def to_dict(self) -> dict:
        rate = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": rate}  # fmt: skip


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    accepted_hist: list[int] = field(default_factory=lambda: [0] * (MAX_DRAFTS + 1))
    # the same rounds by draft source (a proposer's `name`, or DraftSource.NONE)
    by_source: dict[str, SourceStats] = field(
        default_factory=lambda: {name: SourceStats() for name in LISTED}
    )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        """Tokens emitted per verify forward (accepted + recovered + bonus) / rounds."""
        return (self.accepted + self.recovered + self.bonus) / self.rounds if self.rounds else 0.0

    def source(self, name: str) -> SourceStats:
        return self.by_source.setdefault(name, SourceStats())

    def add(self, other: SpecStats) -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist = [
            a + b for a, b in zip(self.accepted_hist, other.accepted_hist, strict=True)
        ]
        for name, theirs in other.by_source.items():
            mine = self.source(name)
            mine.rounds += theirs.rounds
            mine.drafted += theirs.drafted
            mine.accepted += theirs.accepted

    def count(self, source: str, g: int, n: int, bonus: bool | None = None) -> None:
        """One round: g drafts from `source` (a proposer's name), n of them accepted, ending
        in a bonus token (None: n == g, a chain's; a tree's: its path reached a leaf) or a
        recovered one; a round of no drafts counts as DraftSource.NONE whatever its source."""
        self.rounds += 1
        self.drafted += g
        self.accepted += n
        self.accepted_hist[n] += 1
        if not (n == g if bonus is None else bonus):
            self.recovered += 1
        else:
            self.bonus += 1
        mine = self.source(source if g else DraftSource.NONE)
        mine.rounds += 1
        mine.drafted += g
        mine.accepted += n

    @classmethod
    def from_dict(cls, d: dict) -> SpecStats:
        """The inverse of `to_dict`."""
        hist = d["accepted_hist"] + [0] * (MAX_DRAFTS + 1 - len(d["accepted_hist"]))
        by_source = {
            name: SourceStats(s["rounds"], s["drafted"], s["accepted"])
            for name, s in d["sources"].items()
        }
        return cls(*(d[name] for name in COUNTS), hist, by_source)

    def sources(self) -> dict:
        """Rounds, drafts and acceptance per draft source: the 4-bit path ("draft"), the
        document ("lookup"), none ("none": `--gamma auto` chose a plain target step), then
        any other proposer's."""
        names = LISTED + tuple(name for name in self.by_source if name not in LISTED)
        return {name: self.source(name).to_dict() for name in names}

    @property
    def draft_steps(self) -> int:
        """Forward passes on the draft path: the 4-bit self-draft's tokens."""
        return self.source(DraftSource.DRAFT).drafted

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


def plan_fixed(offers: dict[str, int], gamma: int) -> tuple[str, int]:
    """A fixed gamma: the first proposer that offers tokens, up to gamma of them."""
    name, most = next((name, most) for name, most in offers.items() if most)
    return name, min(most, gamma)


@torch.inference_mode()
def speculative_decode(
    runner: Runner,
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
    proposers: Sequence[Proposer] = (),
    draft_vocab: DraftVocab | Callable[[], DraftVocab | None] | None = None,
    costs: StepCosts | None = None,
    trees: bool = True,
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
    With gamma "auto", `trees` and a cache that verifies token trees exactly
    (`verifies_trees`), the planner may also verify several of the document's continuations
    at once (`DocumentTree`).
    `proposers`: more draft sources (`proposers.py`), asked before those two; with a fixed
    gamma the first one that offers tokens drafts the round. `draft_vocab`: the slice of the
    vocabulary the 4-bit draft scores (`draft_vocab.py`), or a function making it at the first
    draft; None: all of it. `costs`: step timings of earlier decodes on this runtime, which a
    new planner starts from and this decode's are added to (`RoundPlanner.from_costs`).
    On any exit (limit, stop token, Ctrl-C, close) the cache is truncated to the committed
    length: exactly the KV of the tokens fed so far, none of a half-finished round.
    """
    timer = timer or StageTimer()
    stats = stats if stats is not None else SpecStats()
    group_size = getattr(cache, "group_size", None)  # (a hierarchical cache's G)
    check_gamma(gamma, group_size)
    limit = gamma_limit(group_size)
    own_planner = gamma == "auto" and planner is None  # (a caller's planner keeps its own)
    if own_planner:
        planner = RoundPlanner.from_costs(limit, costs, start_pos)
    # in the order a fixed gamma tries them: the document's drafts cost no forward pass
    sources = list(proposers)
    if lookup is not None:
        sources.append(DocumentDraft(lookup, timer))
        if trees and planner is not None and verifier is None and _verifies_trees(cache):
            shape = getattr(planner, "shape_tree", None)  # (a scripted planner: the merge)
            sources.append(DocumentTree(sources[-1], timer, shape))
    sources.append(SelfDraft(runner, cache, draft_path, params, generator, timer, draft_vocab))
    by_name = {p.name: p for p in sources}

    def rotation() -> float:
        return getattr(cache, "rotate_seconds", 0.0)

    seed = generator_seed(generator)
    with timer.stage("accept"):
        pending = sample_at(first_logits, params, seed, start_pos)
    emitted_now = [pending]  # what the proposers have not observed yet
    emitted = 1
    committed = start_pos
    try:
        yield pending
        if pending in stop_ids:
            return
        while emitted < max_new_tokens:
            for proposer in sources:
                proposer.observe(emitted_now)
            room = max_new_tokens - emitted  # (never draft past the limit)
            most = min(limit if planner else int(gamma), room)
            offers = {p.name: p.offer(most) for p in sources}
            source, g = planner.plan(offers) if planner else plan_fixed(offers, int(gamma))
            g = min(g, offers[source])  # (a planner may ask the 4-bit path past room)
            rotated, started = rotation(), time.perf_counter()
            drafts, tree = [], None
            if g:
                proposal = by_name[source].propose(RoundContext(pending, committed), g)
                if proposal.is_chain:
                    drafts = proposal.tokens
                elif verifier is not None or not _verifies_trees(cache):
                    raise ValueError(
                        f"proposer {source!r} drafted a token tree, which this cache cannot "
                        "verify exactly (trees need the C++ attention over a hierarchical "
                        "cache) or a custom verifier cannot take"
                    )
                else:
                    tree = proposal
            draft_s = time.perf_counter() - started - (rotation() - rotated)
            rotated, started = rotation(), time.perf_counter()
            with timer.stage("verify"):
                if tree is None:
                    target_logits = forward(
                        runner, cache, [pending] + drafts, committed, target_path
                    )
                else:
                    target_logits = forward_tree(
                        runner, cache, pending, tree, committed, target_path
                    )
            move_rotation_time(cache, timer, "verify", rotated)
            with timer.stage("accept"):
                if tree is None:
                    n, nxt = _accept(drafts, target_logits, params, seed, committed, verifier)
                    path, leaf = None, None
                else:
                    children = tree.children()
                    path, nxt = _accept_tree(tree, children, target_logits, params, seed, committed)
                    drafts = [tree.tokens[row - 1] for row in path[1:]]
                    n, leaf = len(drafts), not children[path[-1]]
            # (the accept stage ends the verify on a GPU: its first read of the logits waits)
            verify_s = time.perf_counter() - started - (rotation() - rotated)
            with timer.stage("rollback"):
                base = committed
                if path is not None:  # the accepted path's K/V where a chain's would be
                    cache.keep_rows(base, path)  # (before `committed` moves: a Ctrl-C inside
                committed = base + 1 + n  # leaves the round uncommitted, as a chain's)
                cache.truncate(committed)
                cache.commit(committed)
            stats.count(source, g, n, leaf)
            if planner is not None:
                steps = getattr(by_name[source], "step_seconds", None) if g else None
                planner.record(source, g, n, draft_s, verify_s, steps)
            emitted_now = drafts[:n] + [nxt]
            for j, token in enumerate(emitted_now):
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
        if own_planner and costs is not None:
            planner.keep(costs, start_pos)


def _verifies_trees(cache) -> bool:
    return bool(getattr(cache, "verifies_trees", False))


def forward_tree(runner, cache, pending: int, tree: DraftTree, position: int, path):
    """The verify of `tree` after the pending token at `position`: logits [1 + len(tree), V],
    row 0 the pending token's, row i + 1 node i's, each seeing its ancestors only."""
    ids = torch.tensor([[pending] + tree.tokens], device=runner.device)
    positions = torch.tensor(tree.depths(), device=runner.device) + position
    with cache.tree_rows(tree.rows()):
        return runner(ids, positions, cache, path)[0]


def _accept_tree(
    tree: DraftTree, children: list[list[int]], target_logits, params, seed: int, position: int
) -> tuple[list[int], int]:
    """(the accepted path's verify rows, root first; the next token) of a tree round, its
    rows' children `tree.children()`; the pending token sits at `position`."""
    tokens = [-1] + tree.tokens
    if params.greedy:
        return verify_tree_greedy(tokens, children, target_logits)
    probs = probabilities(target_logits, params)
    depths = tree.depths()  # (row r's logits are for position + depths[r] + 1)
    return verify_tree_drawn(
        tokens, children, lambda row: draw(probs[row], seed, position + depths[row] + 1)
    )


def _accept(drafts, target_logits, params, seed: int, position: int, verifier) -> tuple[int, int]:
    """(n accepted, the recovered or bonus token) of drafts [g] against target_logits [g + 1,
    V], the pending token at `position`: row j's token sits at position + 1 + j."""
    if params.greedy and verifier is None:
        return verify_greedy(drafts, target_logits)
    if verifier is not None:
        draft_t = torch.tensor(drafts, device=target_logits.device, dtype=torch.long)
        return verifier(draft_t, target_logits)
    probs = probabilities(target_logits, params)
    return verify_drawn(drafts, lambda row: draw(probs[row], seed, position + 1 + row))
