"""The speculative verifier: pure tensor functions, no model, no cache.

Terms (as vLLM's rejection sampler uses them), for one round with gamma draft tokens:
  - accepted tokens: the draft tokens g_1..g_n that pass verification, left to right;
  - recovered token: on the first rejection (n < gamma), a token sampled from the residual
    distribution norm(max(p_{n+1} - q_{n+1}, 0)) instead of g_{n+1};
  - bonus token: when all gamma drafts pass, one more token sampled from p_{gamma+1}.
Every round therefore emits n + 1 tokens. With exact rejection sampling the emitted tokens
follow the target distribution p exactly (Leviathan et al. 2023; Chen et al. 2023).

The engine samples with `verify_drawn` / `verify_tree_drawn` instead: the target's token at
each position is its own draw, keyed by (seed, position) (`sampling.draw`), the drafter drew
from the same noise, and a draft is accepted when it equals that draw. The tokens are then
exactly the target's samples whatever the drafts, so a seed gives the same text for any gamma,
draft source or planner choice (and target-ar's text); the price is a lower acceptance than
rejection sampling's where q and p differ. `verify_sampling` and `verify_tree_sampling` stay
as the rejection-sampling references.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def verify_greedy(
    draft_tokens: torch.Tensor | list[int], target_logits: torch.Tensor
) -> tuple[int, int]:
    """draft_tokens [gamma], target_logits [gamma + 1, V] -> (n_accepted, next_token).

    Accept while argmax p_i == g_i; the next token is argmax p_{n+1} (the recovered token on
    a mismatch, the bonus token when all match). Identical to greedy target decoding.
    One tensor op and one read: it runs between two forward passes, caches cold, where each
    small op costs several times what it does warm.
    """
    top = target_logits.argmax(-1).tolist()  # [gamma + 1]
    drafts = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else draft_tokens
    n = 0
    while n < len(drafts) and drafts[n] == top[n]:
        n += 1
    return n, top[n]


def verify_drawn(drafts: list[int], target_token: Callable[[int], int]) -> tuple[int, int]:
    """(n_accepted, next_token) of drafts [gamma] when `target_token(row)` is the target's own
    token at verify row `row` (a draw keyed by its position): accept while each draft equals
    it; the next token is the target's at the first mismatch, or the bonus row's. Each row's
    draw is made only when reached."""
    n = 0
    while n < len(drafts):
        want = target_token(n)
        if drafts[n] != want:
            return n, want
        n += 1
    return n, target_token(n)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) [V]; falls back to p where p == q (then nothing is ever rejected)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Exact speculative sampling.

    draft_tokens [gamma] sampled from draft_probs [gamma, V] (q_i); target_probs
    [gamma + 1, V] (p_i) for the same positions plus the bonus position. Both must already
    carry the same temperature / top-k / top-p processing. Returns (n_accepted, next_token).
    """
    gamma = draft_tokens.shape[0]
    uniforms = torch.rand(gamma, generator=generator, device=draft_probs.device)
    idx = torch.arange(gamma, device=draft_probs.device)
    p_draft = target_probs[idx, draft_tokens]  # p_i(g_i)
    q_draft = draft_probs[idx, draft_tokens]  # q_i(g_i) > 0: g_i was sampled from q_i
    accept = uniforms * q_draft < p_draft  # u < p/q without dividing
    n = int(accept.int().cumprod(0).sum())
    if n < gamma:
        dist = residual_distribution(target_probs[n], draft_probs[n])
    else:
        dist = target_probs[gamma]
    return n, int(torch.multinomial(dist, 1, generator=generator))


# ------------------------------------------------------------------ token trees (`tree.py`)
# A tree's verify rows: row 0 the pending token, row r > 0 a draft node with token tokens[r]
# whose children rows are children[r] (in the order they were proposed). The verifier walks
# down from row 0 and returns (the accepted path's rows, root first, the next token).


def verify_tree_greedy(
    tokens: list[int], children: list[list[int]], target_logits: torch.Tensor
) -> tuple[list[int], int]:
    """target_logits [rows, V]: at each row on the path, the child whose token is the target's
    argmax there is accepted; the next token is the argmax where no child matches. The same
    tokens as greedy target decoding, as a chain's."""
    top = target_logits.argmax(-1).tolist()
    path = [0]
    while True:
        want = top[path[-1]]
        row = next((r for r in children[path[-1]] if tokens[r] == want), None)
        if row is None:
            return path, want
        path.append(row)


def verify_tree_drawn(
    tokens: list[int], children: list[list[int]], target_token: Callable[[int], int]
) -> tuple[list[int], int]:
    """`verify_tree_greedy` with the target's keyed draw at each row (`target_token(row)`) in
    place of its argmax: the same tokens as a chain's, as target decoding's."""
    path = [0]
    while True:
        want = target_token(path[-1])
        row = next((r for r in children[path[-1]] if tokens[r] == want), None)
        if row is None:
            return path, want
        path.append(row)


def verify_tree_sampling(
    tokens: list[int],
    children: list[list[int]],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Exact multi-candidate speculative sampling (SpecInfer's recursive rejection): at a row
    with target distribution r = p, its children c_1, c_2, ... are tried in order, each
    accepted with probability min(1, r(x) / q(x)) (x its token, q the law it was drawn from:
    draft_probs[c - 1], or a point mass on x where draft_probs is None); a rejection replaces r
    by norm(max(r - q, 0)), an acceptance moves to that child. With every child rejected (or
    none), the next token is drawn from r. Each step is an exact rejection step whatever its
    q, so the emitted tokens follow the target's law p (tests/test_tree.py: the rule by
    enumeration, this function by frequencies and end to end). target_probs [rows, V];
    draft_probs [rows - 1, V] or None."""
    path = [0]
    while True:
        r = target_probs[path[-1]]
        for row in children[path[-1]]:
            x = tokens[row]
            if draft_probs is None:
                q = torch.zeros_like(r)
                q[x] = 1.0
            else:
                q = draft_probs[row - 1]
            u = float(torch.rand(1, generator=generator, device=r.device))
            if u * float(q[x]) < float(r[x]):  # u < r/q without dividing
                path.append(row)
                break
            r = residual_distribution(r, q)
        else:
            return path, int(torch.multinomial(r, 1, generator=generator))
