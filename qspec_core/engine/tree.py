"""A round's drafts as a token tree: several candidate continuations verified in one forward.

A chain of drafts g_1..g_k is the tree where each token's parent is the one before it. A tree
lets one verify spend its rows on alternatives: the continuations of every place where the
context's tail occurred before in the document (`lookup.py`), merged where they agree. The
verify feeds the pending token and every node at once, node i at the position its depth gives,
seeing only its ancestors among the round's tokens (`HierarchicalKVCache.tree_rows`); the
verifier (`verify.py`) walks down from the pending token, and the rollback keeps the accepted
path's K/V (`keep_rows`). Row 0 of a verify is the pending token; node i is row i + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TREE_WIDTH = 4  # continuations a document tree merges: the likeliest match's and 3 others
TREE_DEPTH = 6  # tokens of each: alternatives pay near the root, where a chain is often cut


@dataclass(frozen=True)
class DraftTree:
    """Nodes in an order where a parent comes before its children: tokens [m], parents [m]
    (an earlier node, or -1: a child of the pending token) and, when sampling, each node's
    draft distribution q [m, V] (the law its token was drawn from given its ancestors), or
    None: a point mass on each token (a deterministic proposal, or a greedy draft)."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        for i, up in enumerate(self.parents):
            if not -1 <= up < i:
                raise ValueError(f"node {i}'s parent {up} is not an earlier node or -1")

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    @classmethod
    def merged(cls, paths: Sequence[Sequence[int]], budget: int) -> DraftTree:
        """The trie of `paths` (token lists, the likeliest first), at most `budget` nodes: each
        path adds the nodes it does not share with an earlier one, as many as still fit."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for path in paths:
            up = -1
            for token in path:
                node = children.get((up, token))
                if node is None:
                    if len(tokens) >= budget:
                        break
                    node = children[(up, token)] = len(tokens)
                    tokens.append(int(token))
                    parents.append(up)
                up = node
        return cls(tokens, parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(up == i - 1 for i, up in enumerate(self.parents))

    def rows(self) -> list[int]:
        """The verify's parents [m + 1]: row 0 the pending token (a root), node i row i + 1."""
        return [-1] + [up + 1 for up in self.parents]

    def depths(self) -> list[int]:
        """Each verify row's offset from the pending token's position [m + 1]."""
        depth = [0]
        for up in self.parents:
            depth.append(depth[up + 1] + 1)
        return depth

    def children(self) -> list[list[int]]:
        """Each verify row's child rows, in node order [m + 1]."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, up in enumerate(self.parents):
            out[up + 1].append(i + 1)
        return out

    def depth(self) -> int:
        """The longest path's number of drafts."""
        return max(self.depths())


def priced_tree(
    paths: Sequence[Sequence[int]], acceptance: float, base: float, slope: float, limit: int
) -> tuple[DraftTree, float]:
    """The subtree of `paths`' trie (the likeliest path first) with the most expected tokens
    per second of verify, at most `limit` nodes, and its expected tokens.

    A node's chance to be on the accepted path: a parent's main child (the one most paths go
    through, the first path counting twice: the longest, latest match) has its parent's times
    `acceptance` (a the lookup's measured acceptance, as for a chain); another child its
    parent's times (1 - a) a times its share of the paths that leave the main one there (it
    can only be right where the main child is wrong). A round emits 1 + the sum of its nodes'
    chances, and a verify of m nodes costs base + slope m. Nodes are taken likeliest first
    while the next one raises that ratio: while chance (base + slope m) > tokens x slope.
    A single path gives the chain `planner._best_length` would."""
    weight: dict[int, float] = {}  # node -> weight of the paths through it
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for i, path in enumerate(paths):
        up = -1
        for token in path:
            node = children.get((up, token))
            if node is None:
                node = children[(up, token)] = len(tokens)
                tokens.append(int(token))
                parents.append(up)
            weight[node] = weight.get(node, 0.0) + (2.0 if i == 0 else 1.0)
            up = node
    through = {-1: sum(2.0 if i == 0 else 1.0 for i, path in enumerate(paths) if path)}
    through.update(weight)
    main: dict[int, int] = {}  # parent -> its main child (the first of the heaviest)
    for node, up in enumerate(parents):
        if up not in main or weight[node] > weight[main[up]]:
            main[up] = node
    chance: list[float] = []
    for node, up in enumerate(parents):
        above = 1.0 if up < 0 else chance[up]
        if main[up] == node:
            chance.append(above * acceptance)
        else:
            rest = through[up] - weight[main[up]]
            chance.append(above * (1 - acceptance) * acceptance * weight[node] / rest)
    order = sorted(range(len(tokens)), key=lambda n: -chance[n])
    kept: list[int] = []
    expected = 1.0
    for node in order:  # (a parent's chance exceeds its children's: it comes first)
        if len(kept) >= limit or chance[node] * (base + slope * len(kept)) <= expected * slope:
            break
        kept.append(node)
        expected += chance[node]
    kept.sort()  # (the trie's order: parents before children)
    index = {node: i for i, node in enumerate(kept)}
    tree = DraftTree([tokens[n] for n in kept], [index.get(parents[n], -1) for n in kept])
    return tree, expected
