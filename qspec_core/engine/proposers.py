"""Where a speculative round's drafts come from: a `Proposer` per source.

A round (`speculative.py`) asks each proposer how many tokens it could draft now (`offer`),
lets the planner (or a fixed gamma) pick one proposer and a length, takes that many tokens
from it (`propose`), verifies them, and tells every proposer what was emitted (`observe`).
Three sources ship: the 4-bit self-draft (`SelfDraft`: k forward passes on the draft path),
the document lookup (`DocumentDraft`: the tokens that followed the context's tail earlier in
it, `lookup.py`), and the document's token tree (`DocumentTree`: the continuations of several
earlier occurrences at once, merged where they agree, `tree.py`), named by `DraftSource`.
Another one only has to follow the protocol; its round counts appear in `SpecStats` under its
`name`.

`propose` returns a `DraftTree` (a chain, `DraftTree.chain`, for the first two) with the draft
distributions q [k, V], or None for a point mass on each token (a deterministic proposal, or a
greedy draft): the verifier needs q only when sampling, and builds the one-hot itself then.
Whatever a proposer returns, the round stays an exact speculative round as long as the tokens
were drawn from q (`verify.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from qspec_core.engine.draft_vocab import DraftVocab
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.sampling import SamplingParams, draw, generator_seed, probabilities
from qspec_core.engine.tree import TREE_DEPTH, TREE_WIDTH, DraftTree
from qspec_core.precision import Precision
from qspec_core.timing import StageTimer


class DraftSource(str, Enum):
    """The names a round's drafts are counted, planned and timed under (a proposer's `name`,
    `SpecStats`' keys, the planner's, timer stages): strings, so that JSON reports and keys read
    back from them stay what they were."""

    DRAFT = "draft"  # the 4-bit self-draft (`SelfDraft`)
    LOOKUP = "lookup"  # the document lookup (`DocumentDraft`)
    TREE = "tree"  # the document's token tree (`DocumentTree`)
    NONE = "none"  # no proposer: the round drafted nothing (a plain target step)

    __str__ = str.__str__  # "draft" in messages too, not "DraftSource.DRAFT" (3.11's StrEnum)


@dataclass(frozen=True)
class RoundContext:
    """What a proposer sees of the round: the pending token (sampled, not yet in the cache)
    and its position (the committed length): drafts go at position + 1, + 2, ..."""

    pending: int
    position: int


class Proposer(Protocol):
    """A draft source. `name` keys its stats and the planner's estimates."""

    name: str

    def offer(self, k: int) -> int:
        """How many of the next k tokens it could propose now (0: none)."""
        ...

    def propose(self, context: RoundContext, k: int) -> DraftTree:
        """k draft tokens (k <= the last offer), with their q [k, V] or None: point masses."""
        ...

    def observe(self, accepted: list[int]) -> None:
        """The tokens emitted since the last call (accepted drafts + the recovered/bonus one;
        first, the token sampled from the prefill's logits)."""
        ...


def forward(
    runner, cache, tokens: list[int], position: int, path: Precision, head=None
) -> torch.Tensor:
    """Feed `tokens` at `position`, ... on `path` through `runner` (a `qspec_core.runner.Runner`):
    their logits [len(tokens), V] (through `head` when given: [len(tokens), its rows])."""
    ids = torch.tensor([tokens], device=runner.device)
    positions = torch.arange(position, position + len(tokens), device=runner.device)
    if head is not None:
        return runner(ids, positions, cache, path, head=head)[0]
    return runner(ids, positions, cache, path)[0]


def move_rotation_time(cache, timer: StageTimer, stage: str, before: float) -> None:
    """Rotation happens inside the writes of `stage`: book it under its own stage."""
    spent = getattr(cache, "rotate_seconds", 0.0) - before
    if spent > 0:
        timer.seconds[stage] = timer.seconds.get(stage, 0.0) - spent
        timer.seconds["rotate"] = timer.seconds.get("rotate", 0.0) + spent


class SelfDraft:
    """QuantSpec's draft: the same model on the draft path (4-bit weights over the INT4 KV
    view by default), one forward pass per token, sampling g_i ~ q_i with the noise the target
    draws g_i's position with (`sampling.draw`). Its KV goes into the shared cache; the verify
    overwrites it and the rollback drops the rejected tail.
    `vocab`: the slice of the vocabulary it scores (`draft_vocab.py`); None: all of it; a
    function returning either: called at the second round that drafts (the first scores the
    whole head; a decode that drafts once never slices it). `step_seconds`: each draft
    step's wall time in the last `propose`."""

    name = DraftSource.DRAFT

    def __init__(
        self,
        runner,
        cache,
        path: Precision,
        params: SamplingParams,
        generator: torch.Generator | None,
        timer: StageTimer,
        vocab: DraftVocab | Callable[[], DraftVocab | None] | None = None,
    ):
        self.runner, self.cache, self.path = runner, cache, path
        self.params, self.generator, self.timer = params, generator, timer
        # the slice, or (until the second round) None and the function that makes it
        self.vocab, self._make_vocab = (None, vocab) if callable(vocab) else (vocab, None)
        self.rounds = 0  # `propose` calls so far
        self.step_seconds: list[float] = []

    def offer(self, k: int) -> int:
        return k  # (any length: a forward pass per token)

    def propose(self, context: RoundContext, k: int) -> DraftTree:
        tokens: list[int] = []
        probs = []
        self.step_seconds = []
        rotated = getattr(self.cache, "rotate_seconds", 0.0)
        with self.timer.stage(self.name):
            if self._make_vocab is not None and self.rounds:  # (slicing the head costs more
                self.vocab, self._make_vocab = self._make_vocab(), None  # than the first
            self.rounds += 1  # round's steps save; a second round pays)
            token, vocab = context.pending, self.vocab
            head = vocab.head if vocab is not None else None
            for i in range(k):
                pos = context.position + i
                started = time.perf_counter()
                logits = forward(self.runner, self.cache, [token], pos, self.path, head)[-1]
                if self.params.greedy:
                    index = int(logits.argmax())
                    token = vocab.token(index) if vocab is not None else index
                else:
                    if vocab is not None:
                        logits = vocab.full(logits)  # (q is 0 outside the slice)
                    q = probabilities(logits, self.params)
                    # the target's draw at that position, from the same noise (`draw`)
                    token = draw(q, generator_seed(self.generator), pos + 1)
                    probs.append(q)
                tokens.append(token)
                self.step_seconds.append(time.perf_counter() - started)
        move_rotation_time(self.cache, self.timer, self.name, rotated)
        return DraftTree.chain(tokens, torch.stack(probs) if probs else None)

    def observe(self, accepted: list[int]) -> None:
        pass  # (the cache already holds what it needs)


class DocumentDraft:
    """Drafts copied from the context (`DocumentLookup`): no forward pass, a point mass q."""

    name = DraftSource.LOOKUP

    def __init__(self, index: DocumentLookup, timer: StageTimer):
        self.index, self.timer = index, timer
        self.unseen: list[int] = []  # emitted tokens not indexed yet (indexed at the next offer)
        self.proposal: list[int] = []

    def offer(self, k: int) -> int:
        with self.timer.stage(self.name):
            self.index.extend(self.unseen)
            self.unseen = []
            self.proposal = self.index.propose(k)
        return len(self.proposal)

    def propose(self, context: RoundContext, k: int) -> DraftTree:
        # (a proposal of k tokens is the first k of a longer one: `DocumentLookup.propose`)
        return DraftTree.chain(self.proposal[:k])

    def observe(self, accepted: list[int]) -> None:
        self.unseen += accepted


class DocumentTree:
    """The document's continuations as one tree (`DocumentLookup.continuations`: the tokens
    after up to TREE_WIDTH earlier occurrences of the context's tail, TREE_DEPTH each, merged
    where they agree), shaped by `shape(paths, k)` (the planner's `shape_tree`: the nodes
    that pay for their verify rows) or, without one, the first k nodes of the merge, each
    continuation at most half of them. Offered only where it branches: else the lookup's
    chain is the same round. Shares the lookup's index (`DocumentDraft` extends it);
    point-mass q."""

    name = DraftSource.TREE

    def __init__(self, lookup: DocumentDraft, timer: StageTimer, shape=None):
        self.lookup, self.timer, self.shape = lookup, timer, shape
        self.proposal = DraftTree([], [])

    def offer(self, k: int) -> int:
        # Asked after the lookup's own offer of the round (`speculative_decode` orders them),
        # which indexed the emitted tokens and made the first continuation: its proposal.
        tree = DraftTree([], [])
        main = self.lookup.proposal
        if main:
            with self.timer.stage(self.name):
                depth = TREE_DEPTH if self.shape is not None else min(TREE_DEPTH, max(1, k // 2))
                depth = min(depth, len(main))
                paths = self.lookup.index.continuations(depth, TREE_WIDTH, main[:depth])
                if self.shape is not None:
                    tree = self.shape(paths, k) if len(paths) > 1 else tree
                else:
                    tree = DraftTree.merged(paths, k)
        self.proposal = tree if not tree.is_chain else DraftTree([], [])
        return len(self.proposal)

    def propose(self, context: RoundContext, k: int) -> DraftTree:
        # (a parent comes before its children: the first k nodes are a tree too)
        tree = self.proposal
        probs = None if tree.probs is None else tree.probs[:k]
        return DraftTree(tree.tokens[:k], tree.parents[:k], probs)

    def observe(self, accepted: list[int]) -> None:
        pass  # (the lookup it shares indexes them)
