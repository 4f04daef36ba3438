"""Drafts from the document: when the last tokens already occurred in the context (the prompt
with its document, then what was generated), propose the tokens that followed them there.

Summaries and answers copy the document's names and phrases; such tokens cost a search of
the context to draft instead of several 4-bit forward passes. A proposal is deterministic, so
as a draft distribution it is a point mass q = 1[x]: the verifier accepts x with probability
p(x) and on a rejection samples from p with x removed, renormalized (`verify.py` does exactly
that with a one-hot q), so outputs keep the target's law, and greedy output stays target-ar's.

The match: the longest suffix of the sequence, of n in [min_ngram, max_ngram] tokens, that
also ends earlier with a token after it (the context's own tail never matches itself); of its
occurrences the latest. Each position keeps a hash of the min_ngram tokens ending there
(numpy int64, wrapping); a search compares the last one with all earlier ones at once, then
checks and extends the few candidates token by token. Nothing else is indexed up front: a
dictionary of every n-gram took 13 ms at 4k tokens and 76 ms at 32k before the first token,
a few per cent of a short answer's decode (docs/DESIGN.md). A search runs between two forward
passes, whose weights have just left the caches cold, so it makes few numpy calls.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MIN_NGRAM = 3  # shorter matches (one common word, "of the") proposed mostly wrong tokens
MAX_NGRAM = 8  # the longest suffix tried first: a longer match is a more specific context
# hash of tokens t_{i-n+1..i}: sum_j t_{i-j} M_j mod 2^64 (ids < 2^31, odd M_j < 2^31)
_MULTIPLIERS = (1, 1_000_003, 998_244_353, 754_974_721, 167_772_161, 469_762_049, 7_340_033)
_WRAP = 1 << 64
MANY = 64  # candidates beyond which they are extended all at once (a phrase the text repeats)


class DocumentLookup:
    """A growing token sequence; `propose(k)` drafts up to k tokens copied from it."""

    def __init__(self, tokens: Iterable[int] = (), min_ngram=MIN_NGRAM, max_ngram=MAX_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, not {min_ngram}, {max_ngram}")
        if min_ngram > len(_MULTIPLIERS):
            raise ValueError(f"min_ngram must be at most {len(_MULTIPLIERS)}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        # The tokens twice: a list for the scalar reads of a few candidates' checks (a numpy
        # scalar read is a call) and a numpy copy [capacity] for the vectorized ones; and
        # hashes[i] [capacity], of the min_ngram tokens ending at i (i >= min_ngram - 1).
        self.tokens: list[int] = [int(t) for t in tokens]
        n, lo = len(self.tokens), min_ngram
        self._seq = np.zeros(max(64, 2 * n), dtype=np.int64)
        self._seq[:n] = self.tokens
        self._hashes = np.zeros_like(self._seq)
        for j in range(lo if n >= lo else 0):  # (vectorized: the prompt at once)
            self._hashes[lo - 1 : n] += self._seq[lo - 1 - j : n - j] * _MULTIPLIERS[j]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq, lo = self.tokens, self.min_ngram
        for token in tokens:
            seq.append(int(token))
            i = len(seq) - 1
            if i >= len(self._seq):  # (doubling: a token at a time stays O(1))
                self._seq = np.concatenate((self._seq, np.zeros_like(self._seq)))
                self._hashes = np.concatenate((self._hashes, np.zeros_like(self._hashes)))
            self._seq[i] = seq[i]
            if i >= lo - 1:  # the same wrap as numpy's int64 products and sums
                h = sum(seq[i - j] * _MULTIPLIERS[j] for j in range(lo)) % _WRAP
                self._hashes[i] = h - _WRAP if h >= _WRAP >> 1 else h

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the longest suffix (>= min_ngram tokens) of the sequence at
        its latest earlier occurrence; [] when no suffix occurred before. A copy that runs
        into the sequence's end goes on copying itself (the sequence repeats with period
        len - at: "a b a b" proposes "a b a ..."), so a proposal is always k tokens."""
        seq, end, lo = self.tokens, len(self.tokens), self.min_ngram
        if k <= 0 or end <= lo:
            return []
        # at: the token after an occurrence (its hash at at - 1), in [lo, end)
        hashes = self._hashes
        found = np.flatnonzero(hashes[lo - 1 : end - 1] == hashes[end - 1])
        J = min(self.max_ngram, end)
        if len(found) > MANY:
            start = self._latest_longest(found + lo, J)
        else:
            start = self._latest_longest_few(found.tolist(), J)
        if start < 0:
            return []
        out = seq[start : start + k]
        while len(out) < k:
            out.append(out[start + len(out) - end])
        return out

    def continuations(self, k: int, width: int, first: list[int] | None = None) -> list[list[int]]:
        """Up to `width` different continuations of the sequence's tail: the k tokens (fewer
        where the sequence ends) after each earlier occurrence of its last min_ngram tokens,
        the occurrences with the longest match first, the latest first among equals; the
        first is `propose(k)`'s (`first`: that proposal, made already). [] when the tail
        never occurred before."""
        first = self.propose(k) if first is None else first
        if not first or width <= 1:
            return [first] if first else []
        seq, end, lo = self.tokens, len(self.tokens), self.min_ngram
        hashes = self._hashes
        at = np.flatnonzero(hashes[lo - 1 : end - 1] == hashes[end - 1]) + lo  # [C]
        J = min(self.max_ngram, end)
        back = at[:, None] - 1 - np.arange(J)  # [C, J]: each occurrence's tokens, backwards
        same = (back >= 0) & (self._seq[np.maximum(back, 0)] == self._seq[end - J : end][::-1])
        length = np.cumprod(same, axis=1).sum(axis=1)  # [C]
        order = np.lexsort((-at, -length))  # longest, then latest, first
        out, seen = [first], {tuple(first)}
        for i in order.tolist():
            if length[i] < lo:
                break
            path = seq[int(at[i]) : int(at[i]) + k]
            if path and tuple(path) not in seen:
                seen.add(tuple(path))
                out.append(path)
                if len(out) == width:
                    break
        return out

    def _latest_longest_few(self, candidates: list[int], J: int) -> int:
        """Of the candidates (hash matches; at = c + min_ngram), the latest whose match with
        the suffix is longest, at least min_ngram tokens (up to J), checked token by token;
        -1: none (a hash collision)."""
        seq, end, lo = self.tokens, len(self.tokens), self.min_ngram
        best, start = lo - 1, -1
        for at in reversed(candidates):  # the latest first: only a longer match replaces it
            at += lo
            n = 0
            while n < J and n < at and seq[at - 1 - n] == seq[end - 1 - n]:
                n += 1
            if n > best:
                best, start = n, at
                if n == J:
                    break
        return start

    def _latest_longest(self, at: np.ndarray, J: int) -> int:
        """`_latest_longest_few` for many candidates at [C] at once: [C, J] comparisons."""
        seq, end = self._seq, len(self.tokens)
        back = at[:, None] - 1 - np.arange(J)  # [C, J]: each occurrence's tokens, backwards
        same = (back >= 0) & (seq[np.maximum(back, 0)] == seq[end - J : end][::-1])
        length = np.cumprod(same, axis=1).sum(axis=1)  # [C]: suffix tokens matched
        longest = int(length.max())
        return int(at[length == longest].max()) if longest >= self.min_ngram else -1
