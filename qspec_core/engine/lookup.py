"""Drafts from the document: when the last tokens already occurred in the context (the prompt
with its document, then what was generated), propose the tokens that followed them there.

Summaries and answers copy the document's names and phrases; such tokens cost a dictionary
lookup to draft instead of several 4-bit forward passes. A proposal is deterministic, so as a
draft distribution it is a point mass q = 1[x]: the verifier accepts x with probability p(x)
and on a rejection samples from p with x removed, renormalized (`verify.py` does exactly that
with a one-hot q), so outputs keep the target's law, and greedy output stays target-ar's.

The index maps every n-gram (n in [min_ngram, max_ngram]) to the position that followed its
latest occurrence, so a lookup costs O(max_ngram) dictionary probes whatever the document's
length, and appending a token costs one insertion per n. An n-gram enters the index only once
the token after it exists: the context's own tail never matches itself.
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_NGRAM = 3  # shorter matches (one common word, "of the") proposed mostly wrong tokens
MAX_NGRAM = 8  # the longest suffix tried first: a longer match is a more specific context


class DocumentLookup:
    """An n-gram index over a growing token sequence; `propose(k)` drafts up to k tokens."""

    def __init__(self, tokens: Iterable[int] = (), min_ngram=MIN_NGRAM, max_ngram=MAX_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, not {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # n-gram (a tuple of n ids) -> index in `tokens` of the token that followed it last
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq, index = self.tokens, self._next
        for token in tokens:
            end = len(seq)  # seq[end] is the new token: every n-gram ending before it is done
            seq.append(int(token))
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index[tuple(seq[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the longest suffix (>= min_ngram tokens) of the sequence at
        its latest earlier occurrence; [] when no suffix occurred before. A copy that runs
        into the sequence's end goes on copying itself (the sequence repeats with period
        len - at: "a b a b" proposes "a b a ..."), so a proposal is always k tokens."""
        seq, end = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            at = self._next.get(tuple(seq[end - n :]))
            if at is not None:
                out = seq[at : at + k]
                while len(out) < k:
                    out.append(out[at + len(out) - end])
                return out
        return []
