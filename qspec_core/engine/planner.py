"""What a speculative round drafts: `--gamma auto` by cost.

Each round may draft k tokens on the 4-bit path (k draft steps, then a verify of k + 1 rows),
take k tokens proposed by the document lookup (no draft step), or draft nothing (a verify of
one row is a plain target step). Which one pays depends on the machine and the context: on a
2-core CPU at 2k tokens a draft step costs most of a target step and drafting loses to plain
decoding; on a GPU, or at 32k where the INT4 KV view pays, drafting wins. So the planner
measures, while decoding:
  - the seconds of a draft step, d;
  - the seconds of a verify of m rows, v(m), a line a + b (m - 1) through the row counts seen
    (each the lower median of its last 16 observations: the first rounds pay for lazy weight
    packing or kernel compilation, which a mean would carry for hundreds of rounds): once
    plain steps are timed, a = v(1) and b the lower median of the slopes from it to each other
    count, so that one slow verify of a count timed once does not tilt the line (it did: a
    7-row verify at 3x its time cut v(1) to 75% and then priced every lookup out);
  - per draft source, the acceptance a of a drafted token that was tested (the tokens up to
    and including the first rejection);
and picks the option with the most expected tokens per second (the first rounds time a
draft round, then a plain step, the baseline every option is priced against):
  E(k) / cost, E(k) = 1 + a + ... + a^k (the accepted run, plus the recovered/bonus token),
  cost = k d + v(k + 1) for the 4-bit path, v(k + 1) for the lookup.
The 4-bit path's acceptance is measured only where it drafts, so every EXPLORE_EVERY rounds
without it, it is tried again, but only where it could win at OPTIMISM more acceptance than
measured: on a CPU where its step costs most of a target step, no round is spent on it.
A free source (the lookup) that has been offered and passed over for plain steps RETRY_FREE
times in a row is tried for one token: its acceptance changes along a text (a licence's
summary copies nothing for 100 tokens, then whole clauses), and a decode that recalled steep
verify timings from an earlier document (`from_costs`) would otherwise never time a 2-row
verify again. One try costs one verify row, about a tenth of a step, every RETRY_FREE + 1
rounds at worst.
A token tree (the document's continuations merged, `proposers.DocumentTree`) is shaped here
(`shape_tree`, `tree.priced_tree`): of the continuations' trie, the nodes whose chance of
acceptance (the lookup's for the main continuation; for another, where the main one is wrong,
split by how many continuations agree) pays for their verify rows on the measured line.
It is then taken whole: its rate is (1 + n) / v(m + 1), m its nodes and n the tokens its
rounds accepted on average (until measured, the shape's own estimate, weight PRIOR_TOKENS
rounds), so it runs only where its alternatives pay; the retry above alternates between the
free sources.
A choice depends only on the past, so every round stays an exact speculative round: greedy
output is target-ar's and sampled output follows the target's law whatever the planner picks.

`from_costs` starts a planner from the step timings an earlier decode on the same runtime
measured (`qspec_core.timing.StepCosts`): a chat's next question or a folder's next document
then skips the timing round, which on a CPU where drafting loses is the only 4-bit round.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qspec_core.engine.proposers import DraftSource
from qspec_core.engine.tree import DraftTree, priced_tree
from qspec_core.timing import StepCosts

DECAY = 0.9  # weight of the past in the acceptance estimates: about the last 10 rounds
RECENT = 16  # timings kept per kind
# until measured; weight PRIOR_TOKENS
PRIOR_ACCEPTANCE = {DraftSource.DRAFT: 0.7, DraftSource.LOOKUP: 0.6}
PRIOR_TOKENS = 2.0
SLOPE_PRIOR = 0.1  # v(m) = v(1) (1 + 0.1 (m - 1)) until two row counts have been timed
EXPLORE_EVERY = 32  # rounds without a 4-bit draft before one may be tried again
OPTIMISM = 0.1  # acceptance added to the 4-bit path's when deciding whether to try it again
START_GAMMA = 2  # the first round drafts this many on the 4-bit path, to time a step
RETRY_FREE = 8  # offers of a free source passed over before it is tried for one token
# sources whose proposal is verified whole: rated per round, not per token
WHOLE = (DraftSource.TREE,)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one round emits with k drafts, each accepted with probability a given the
    previous ones: 1 + a + ... + a^k."""
    return float(sum(acceptance**i for i in range(k + 1)))


def _best_length(acceptance: float, step: float, verify, lo: int, hi: int) -> tuple[int, float]:
    """(k, tokens per second) of the best k in lo..hi: E(k) / (k step + v(k + 1))."""
    best = (lo, expected_tokens(acceptance, lo) / (lo * step + verify(lo + 1)))
    for k in range(lo + 1, hi + 1):
        rate = expected_tokens(acceptance, k) / (k * step + verify(k + 1))
        if rate > best[1]:
            best = (k, rate)
    return best


def _lower_median(values) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class _Recent:
    """The lower median of the last RECENT values: robust to a slow first call."""

    def __init__(self):
        self.values: deque[float] = deque(maxlen=RECENT)

    def add(self, value: float) -> None:
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    @property
    def value(self) -> float | None:
        return _lower_median(self.values) if self.values else None


@dataclass
class _Decayed:
    """A sum whose older terms fade by DECAY per new one."""

    total: float = 0.0

    def add(self, value: float) -> None:
        self.total = DECAY * self.total + value


@dataclass
class RoundPlanner:
    """`plan(offers)` -> (source, k): "draft" (k >= 0 steps on the 4-bit path; 0 is a plain
    target step) or another proposer (the first k of the tokens it offers, free but for the
    verify: the document lookup). Then `record` the round."""

    limit: int  # most drafts a round may have (the cache's slack)
    draft_step: _Recent = field(default_factory=_Recent)  # seconds per draft step
    verify: dict[int, _Recent] = field(default_factory=dict)  # rows -> seconds
    tested: dict[str, _Decayed] = field(default_factory=dict)  # source -> drafts tested
    accepted: dict[str, _Decayed] = field(default_factory=dict)  # source -> drafts accepted
    rounds_since_draft: int = 0
    passed_over: int = 0  # free-source offers passed over in a row
    retries: int = 0  # free sources retried so far (the retry alternates between them)
    shaped: float = 0.0  # the last tree's expected accepted tokens (`shape_tree`)

    @classmethod
    def from_costs(cls, limit: int, costs: StepCosts | None, context: int) -> RoundPlanner:
        """A planner whose timings start as `costs` recalls them for `context` (none: the
        timing round first)."""
        planner = cls(limit)
        seen = costs.recall(context) if costs is not None else None
        if seen is not None:
            draft, verify = seen
            for seconds in draft:
                planner.draft_step.add(seconds)
            for rows, values in verify.items():
                for seconds in values:
                    planner.verify.setdefault(rows, _Recent()).add(seconds)
        return planner

    def keep(self, costs: StepCosts, context: int) -> None:
        """Hand this decode's timings to `costs` for the next decode; none without the two
        draft step timings a planner starts from (a decode that never drafted)."""
        if len(self.draft_step) < 2:
            return
        verify = {rows: list(r.values) for rows, r in self.verify.items()}
        costs.keep(context, list(self.draft_step.values), verify)

    def acceptance(self, source: str) -> float:
        acc, tested = self.accepted.get(source), self.tested.get(source)
        prior = PRIOR_ACCEPTANCE.get(source, PRIOR_ACCEPTANCE[DraftSource.LOOKUP])
        a = (acc.total if acc else 0.0) + prior * PRIOR_TOKENS
        t = (tested.total if tested else 0.0) + PRIOR_TOKENS
        return min(a / t, 0.999)

    def shape_tree(self, paths: list[list[int]], limit: int) -> DraftTree:
        """The tree worth verifying of the document's continuations `paths` (likeliest
        first), at most `limit` nodes (`tree.priced_tree`); empty before a verify is timed."""
        v = self.verify_line()
        if v is None:
            return DraftTree([], [])
        base = v(1)
        tree, expected = priced_tree(
            paths, self.acceptance(DraftSource.LOOKUP), base, v(2) - base, min(limit, self.limit)
        )
        self.shaped = expected - 1
        return tree

    def whole_tokens(self, source: str) -> float:
        """Tokens a round of `source` (one of WHOLE) accepts on average: its rounds' decayed
        mean, starting from the last shape's estimate."""
        acc, rounds = self.accepted.get(source), self.tested.get(source)
        a = (acc.total if acc else 0.0) + self.shaped * PRIOR_TOKENS
        return a / ((rounds.total if rounds else 0.0) + PRIOR_TOKENS)

    def verify_seconds(self, rows: int) -> float | None:
        """v(rows), from `verify_line`."""
        line = self.verify_line()
        return None if line is None else line(rows)

    def verify_line(self):
        """v as a function of the rows (never falling with more rows), or None before any
        verify: through v(1) with the lower median of the slopes to the other row counts once
        plain steps are timed, else the least-squares line through the counts seen."""
        seen = [(m, r.value) for m, r in self.verify.items() if r.value is not None]
        if not seen:
            return None
        if len(seen) == 1:
            m0, v0 = seen[0]
            base = v0 / (1 + SLOPE_PRIOR * (m0 - 1))
            return lambda rows: base * (1 + SLOPE_PRIOR * (rows - 1))
        plain = dict(seen).get(1)
        if plain is not None:
            slope = max(0.0, _lower_median((v - plain) / (m - 1) for m, v in seen if m > 1))
            return lambda rows: plain + slope * (rows - 1)
        n = len(seen)
        mx = sum(m for m, _ in seen) / n
        my = sum(v for _, v in seen) / n
        sxx = sum((m - mx) ** 2 for m, _ in seen)
        slope = max(0.0, sum((m - mx) * (v - my) for m, v in seen) / sxx)
        return lambda rows: max(my + slope * (rows - mx), 1e-9)

    def plan(self, offers: dict[str, int]) -> tuple[str, int]:
        """offers: proposer name -> how many tokens it could draft now (`proposers.py`)."""
        d, v = self.draft_step.value, self.verify_line()
        if len(self.draft_step) < 2 or v is None:
            return DraftSource.DRAFT, min(START_GAMMA, self.limit)  # time a draft step and a verify
        if 1 not in self.verify:
            # Time a plain step next: it is target-ar's own step, so it never loses against
            # it, and every option is priced against it. Guessed from the timing round's
            # verify by SLOPE_PRIOR, it was 1.6x too dear on a CPU whose extra verify rows
            # cost 0.45 of a step, and the planner then drafted at a loss for a whole answer.
            return DraftSource.DRAFT, 0
        best, best_rate = (DraftSource.DRAFT, 0), 0.0
        # the 4-bit path first: on a tie the earlier option stays
        for source in sorted(offers, key=lambda name: name != DraftSource.DRAFT):
            # the 4-bit path pays a draft step per token, any other source only the verify
            stepped = source == DraftSource.DRAFT
            step, most = (d, self.limit) if stepped else (0.0, min(offers[source], self.limit))
            if not stepped and most < 1:
                continue  # (nothing offered)
            if source in WHOLE:
                k, rate = most, (1 + self.whole_tokens(source)) / v(most + 1)
            else:
                k, rate = _best_length(self.acceptance(source), step, v, 0 if stepped else 1, most)
            if rate > best_rate:
                best, best_rate = (source, k), rate
        # (counted against plain steps only: where the 4-bit path wins, its rounds pay more)
        if best[0] != DraftSource.DRAFT:
            self.passed_over = 0
        elif not best[1] and self.limit >= 1:
            free = [
                name for name in sorted(offers) if name != DraftSource.DRAFT and offers[name] > 0
            ]
            self.passed_over += bool(free)
            if self.passed_over > RETRY_FREE:
                self.passed_over = 0
                self.retries += 1
                name = free[self.retries % len(free)]
                return name, min(offers[name], self.limit) if name in WHOLE else 1
        if best[0] == DraftSource.DRAFT and best[1] or self.rounds_since_draft < EXPLORE_EVERY:
            return best
        # Time to try the 4-bit path again (its acceptance may have moved), but only where it
        # could win: at OPTIMISM more acceptance than measured. Where it loses even then (a
        # CPU whose draft step costs most of a target step), no round is spent on it.
        a = min(self.acceptance(DraftSource.DRAFT) + OPTIMISM, 0.999)
        k, rate = _best_length(a, d, v, 1, self.limit)
        return (DraftSource.DRAFT, k) if rate >= best_rate else best

    def record(self, source, k, n, draft_seconds, verify_seconds, step_seconds=None) -> None:
        """A round of k drafts from `source` with n accepted; its measured stage seconds, and
        each 4-bit draft step's where known (`SelfDraft.step_seconds`): then one round gives
        the two timings the start needs, its first step's cold start one of them."""
        if source == DraftSource.DRAFT and k:
            for seconds in step_seconds or [draft_seconds / k]:
                self.draft_step.add(seconds)
            self.rounds_since_draft = 0
        else:
            self.rounds_since_draft += 1
        self.verify.setdefault(k + 1, _Recent()).add(verify_seconds)
        if k:
            self.accepted.setdefault(source, _Decayed()).add(n)
            # (a whole proposal's rounds; else the tokens tested: up to the first rejection)
            self.tested.setdefault(source, _Decayed()).add(1 if source in WHOLE else n + (n < k))
