"""Token trees (`engine/tree.py`): a verify of several candidate continuations at once.

What must hold: a tree row's logits are, bit for bit, those of the same tokens fed as a chain
(native stack, layer loop) and close to them on the PyTorch reference; after the rollback the
cache holds the accepted path's K/V exactly where a chain's would be; greedy decoding over
tree rounds is target-ar's; the multi-candidate rejection rule keeps the target's law
(enumerated, and by frequencies); the document's continuations merge into a trie."""

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf
from test_lookup import RandomPlanner, exact_laws
from test_speculative import _g, _run

from kernels.cpu import build as cpu_ext
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.generate import prefill_hierarchical
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.planner import RoundPlanner
from qspec_core.engine.proposers import RoundContext
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats, forward_tree, speculative_decode
from qspec_core.engine.tree import DraftTree, priced_tree
from qspec_core.engine.verify import (
    residual_distribution,
    verify_tree_greedy,
    verify_tree_sampling,
)
from qspec_core.model.transformer import attach_draft, attach_int8, linear_layers
from qspec_core.precision import DRAFT, TARGET, W8_TARGET
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.runner import CpuRunner, TorchRunner, build_runner

native = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")

# a pending token's tree: two roots' subtrees, one three deep, a leaf between them
TREE = DraftTree([11, 12, 13, 21, 31, 32, 14], [-1, 0, 1, -1, -1, 4, 1])


def _model(head_dim=64, seed=0, vocab=101, window=None):
    """head_dim 64: the vector attention; 16: the portable one. window: a Mistral's sliding
    window on every layer, else a Llama."""
    kw = dict(hidden_size=2 * head_dim, intermediate_size=192, num_attention_heads=2)
    kw.update(vocab_size=vocab, num_key_value_heads=1)
    if window:
        kw.update(sliding_window=window, max_position_embeddings=512)
    model = ours_from_hf(tiny_hf("mistral" if window else "llama", seed=seed, **kw))
    drafts = {n: Int4Linear.from_linear(m, 32) for n, m in linear_layers(model).items()}
    attach_draft(model, drafts)
    return model


class LoopRunner(CpuRunner):
    """The CPU runner without its stack: the model's layer loop on the runner's ops."""

    def stack(self, weights):
        return None


def _runner(kind, model):
    if kind == "torch":
        return TorchRunner(model)
    ext = cpu_ext.load()
    return CpuRunner(model, ext) if kind == "stack" else LoopRunner(model, ext)


def test_a_trie_merges_continuations_and_keeps_its_budget():
    tree = DraftTree.merged([[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]], budget=6)
    assert tree.tokens == [1, 2, 3, 4, 5, 6] and tree.parents == [-1, 0, 1, 1, -1, 4]
    assert DraftTree.merged([[1, 2, 3], [1, 2, 4], [5, 6]], budget=4).tokens == [1, 2, 3, 4]
    assert DraftTree.merged([[1, 2], [1, 2]], budget=8).is_chain
    assert TREE.rows() == [-1, 0, 1, 2, 0, 0, 5, 2]
    assert TREE.depths() == [0, 1, 2, 3, 1, 1, 2, 3]
    assert TREE.children() == [[1, 4, 5], [2], [3, 7], [], [], [6], [], []]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])  # (a node its own parent)


def test_the_document_offers_every_occurrences_continuation():
    index = DocumentLookup([1, 2, 3, 4, 1, 2, 3, 9, 8, 1, 2, 3, 5, 1, 2, 3], min_ngram=3)
    paths = index.continuations(2, width=4)
    assert paths[0] == index.propose(2) == [5, 1]  # the latest first: the chain's proposal
    assert sorted(paths[1:]) == [[4, 1], [9, 8]]
    assert index.continuations(2, width=1) == [[5, 1]]
    assert DocumentLookup([1, 2, 3], min_ngram=3).continuations(4, 4) == []


def _chains(runner, cache, point, pending, start, path):
    """Each row of TREE (after `pending` at `start`) with its path from the root and the last
    logits of that chain fed alone over the cache restored to `point`: (row, chain, logits)."""
    tokens, parents = [pending] + TREE.tokens, TREE.rows()
    for row in range(len(tokens)):
        chain = [row]
        while parents[chain[0]] >= 0:
            chain.insert(0, parents[chain[0]])
        cache.restore(point)
        fed = torch.tensor([[tokens[r] for r in chain]])
        yield row, chain, runner(fed, torch.arange(start, start + len(chain)), cache, path)[0, -1]


@native
@pytest.mark.parametrize("kind", ["stack", "loop"])
@pytest.mark.parametrize("path", [TARGET, W8_TARGET, W8_TARGET.with_weights("w8a8")])
@pytest.mark.parametrize("head_dim, start", [(64, 126), (64, 60), (16, 45)])
def test_tree_rows_have_the_bits_of_the_chain_that_reaches_them(kind, path, head_dim, start):
    """Each row of a tree verify (the target paths: a verify's) against the chain of its path, fed
    alone over the same committed cache: equal logits, bit for bit. start 126 puts the rows at
    depth 2-3 past the group boundary at 128 (late queries, F1 read from the planes) and their
    paths across a block of keys; start 60 inside F1."""
    model = _model(head_dim)
    attach_int8(model, {n: Int8Linear.from_linear(m) for n, m in linear_layers(model).items()})
    if path.weights not in model.weight_sets:
        pytest.skip("w8a8 needs in_features a multiple of 64")
    runner = _runner(kind, model)
    ids = torch.randint(0, 101, (1, start + 1), generator=_g(1))
    cache = HierarchicalKVCache(model.config, 300, dtype=torch.float32)
    with torch.no_grad():
        prefill_hierarchical(runner, cache, ids[0, :start].tolist())
        point = cache.checkpoint()
        pending = int(ids[0, start])
        got = forward_tree(runner, cache, pending, TREE, start, path)
        for row, chain, want in _chains(runner, cache, point, pending, start, path):
            assert torch.equal(got[row], want), (row, chain)


@native
@pytest.mark.parametrize("kind", ["stack", "torch"])
@pytest.mark.parametrize("start, window", [(200, 90), (126, 20)])
def test_windowed_tree_rows_see_what_their_chains_see(kind, start, window):
    """A sliding window over a tree's rows: each row's oldest visible position follows its
    depth, as its chain's does (the window cutting the history at 200, the region at 126):
    bit for bit on the C++ stack, to rounding on the reference."""
    model = _model(64, window=window)
    runner = _runner(kind, model)
    ids = torch.randint(0, 101, (1, start + 1), generator=_g(3))
    cache = HierarchicalKVCache(model.config, 300, dtype=torch.float32)
    cache.fused = None if kind == "stack" else False  # (torch: the reference attention)
    with torch.no_grad():
        prefill_hierarchical(runner, cache, ids[0, :start].tolist())
        point = cache.checkpoint()
        pending = int(ids[0, start])
        got = forward_tree(runner, cache, pending, TREE, start, TARGET)
        for row, chain, want in _chains(runner, cache, point, pending, start, TARGET):
            if kind == "stack":
                assert torch.equal(got[row], want), (row, chain)
            else:
                torch.testing.assert_close(got[row], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("path", [TARGET, DRAFT])
def test_the_reference_attention_sees_the_same_tree(path):
    """The PyTorch runner (the model's own loop, the reference attention): tree rows against
    their chains to rounding (its softmax is one call over every key, masked)."""
    model = _model(16)
    runner = TorchRunner(model)
    ids = torch.randint(0, 101, (1, 46), generator=_g(2)).tolist()[0]
    cache = HierarchicalKVCache(model.config, 300, dtype=torch.float32)
    cache.fused = False
    with torch.no_grad():
        prefill_hierarchical(runner, cache, ids[:45])
        point = cache.checkpoint()
        got = forward_tree(runner, cache, ids[45], TREE, 45, path)
        for row, chain in ((3, [0, 1, 2, 3]), (6, [0, 5, 6]), (7, [0, 1, 2, 7])):
            cache.restore(point)
            fed = torch.tensor([[([ids[45]] + TREE.tokens)[r] for r in chain]])
            want = runner(fed, torch.arange(45, 45 + len(chain)), cache, path)[0, -1]
            torch.testing.assert_close(got[row], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["stack", "torch"])
@pytest.mark.parametrize("start", [120, 40])
def test_keep_rows_leaves_the_kv_a_chain_would(kind, start):
    """After a tree verify, keeping path rows [0, 1, 2, 7] moves exactly those rows' K/V to
    slots start..start + 3 in every layer (start 40: inside F1); on the C++ stack the cache
    then equals one fed those four tokens as a chain, and so do the next step's logits."""
    if kind == "stack" and not cpu_ext.available():
        pytest.skip("no C++ compiler here")
    model = _model(64)
    runner = _runner(kind, model)
    ids = torch.randint(0, 101, (130,), generator=_g(3)).tolist()
    path = [0, 1, 2, 7]
    with torch.no_grad():
        caches = []
        for use_tree in (True, False):
            cache = HierarchicalKVCache(model.config, 300, dtype=torch.float32)
            prefill_hierarchical(runner, cache, ids[:start])
            lo = start - cache.n_quant[0]
            if use_tree:
                forward_tree(runner, cache, ids[start], TREE, start, TARGET)
                written = cache.fp_k.clone(), cache.fp_v.clone()
                cache.keep_rows(start, path)
                for fp, before in zip((cache.fp_k, cache.fp_v), written, strict=True):
                    for i, row in enumerate(path):
                        assert torch.equal(fp[:, :, :, lo + i], before[:, :, :, lo + row])
                    assert torch.equal(fp[:, :, :, :lo], before[:, :, :, :lo])
            else:
                fed = torch.tensor([[ids[start], 11, 12, 14]])
                runner(fed, torch.arange(start, start + 4), cache, TARGET)
                cache.truncate(start + 4)
            cache.commit(start + 4)
            step = torch.tensor([[5]]), torch.tensor([start + 4])
            caches.append((cache, runner(*step, cache, TARGET)[0, -1]))
        (tree, a), (chain, b) = caches
        assert tree.seq_len == chain.seq_len == start + 5 and tree.fp_len == chain.fp_len
        if kind == "stack":  # (the C++ kernels: a row's bits whatever rows come with it)
            n = tree.fp_len[0]
            assert torch.equal(tree.fp_k[:, :, :, :n], chain.fp_k[:, :, :, :n])
            assert torch.equal(tree.fp_v[:, :, :, :n], chain.fp_v[:, :, :, :n])
            assert torch.equal(a, b)


def test_tree_greedy_walks_down_the_targets_argmax():
    tokens, children = [-1] + TREE.tokens, TREE.children()
    logits = torch.zeros(8, 40)
    for row, best in enumerate([11, 12, 14, 0, 0, 0, 0, 9]):
        logits[row, best] = 1.0
    assert verify_tree_greedy(tokens, children, logits) == ([0, 1, 2, 7], 9)
    logits[0] = 0
    logits[0, 31] = 1.0  # the third root
    logits[5] = 0
    logits[5, 33] = 1.0  # no child of 31 matches
    assert verify_tree_greedy(tokens, children, logits) == ([0, 5], 33)


def test_recursive_rejection_over_siblings_keeps_the_law_by_enumeration():
    """The rule `verify_tree_sampling` implements, written out: siblings x_1, x_2, x_3 tried
    in order with any laws q_i (point masses among them), each rejection leaving
    norm(max(r - q_i, 0)): P(emit y) sums to p(y) exactly. (The function itself: by
    frequencies below, and end to end.)"""
    g = _g(4)
    for _ in range(30):
        p = torch.rand(6, generator=g) ** 3
        p[int(torch.randint(0, 6, (1,), generator=g))] = 0.0
        p /= p.sum()
        qs = []
        for i in range(3):
            q = torch.rand(6, generator=g) ** 3
            if i != 1:  # the middle sibling a point mass
                q = torch.zeros(6)
                q[int(torch.randint(0, 6, (1,), generator=g))] = 1.0
            qs.append(q / q.sum())
        emitted, r, still = torch.zeros(6), p.clone(), 1.0  # still: P(every sibling so far failed)
        for q in qs:
            accept = q * torch.minimum(torch.ones(6), r / q.clamp(min=1e-30)) * (q > 0)
            emitted += still * accept
            still *= 1 - float(accept.sum())
            r = residual_distribution(r, q)
        emitted += still * r
        torch.testing.assert_close(emitted, p, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sampled", [False, True])
def test_tree_sampling_frequencies_follow_the_target(sampled):
    """Root with two children (point masses 1 and 3, or two tokens drawn from q each time as
    SpecInfer draws them), child 0 with child 2: the first emitted token ~ p_0 and, after a 1
    was accepted at row 1, the second ~ p_1. n = 40000, bound 0.012 (~5 sigma)."""
    p = torch.tensor(
        [
            [0.4, 0.3, 0.1, 0.15, 0.05],
            [0.1, 0.2, 0.5, 0.1, 0.1],
            [0.2] * 5,
            [0.6, 0.1, 0.1, 0.1, 0.1],
        ]
    )
    q = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1])
    g = _g(5)
    first, second, n_second = torch.zeros(5), torch.zeros(5), 0
    for _ in range(40000):
        if sampled:
            a, b = (int(torch.multinomial(q, 1, generator=g)) for _ in range(2))
            point = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])  # (the fixed token 2's law)
            tokens, probs = [-1, a, 2, b], torch.stack([q, point, q])
        else:
            tokens, probs = [-1, 1, 2, 3], None
        path, nxt = verify_tree_sampling(tokens, [[1, 3], [2], [], []], probs, p, g)
        emitted = [tokens[r] for r in path[1:]] + [nxt]
        first[emitted[0]] += 1
        if path[1:2] == [1] and emitted[0] == 1:
            second[emitted[1]] += 1
            n_second += 1
    assert (first / 40000 - p[0]).abs().max() < 0.012
    assert n_second > 5000 and (second / n_second - p[1]).abs().max() < 0.03


class TreeOracle:
    """Proposes a tree whose right continuation (target-ar's, known) is the second branch of
    the first node and of a deeper one, wrong tokens on the first: only tree rounds that take
    the alternatives give target-ar's tokens."""

    name = "oracle"

    def __init__(self, expected: list[int], start: int):
        self.expected, self.start = expected, start

    def offer(self, k: int) -> int:
        return 6

    def propose(self, context: RoundContext, k: int) -> DraftTree:
        i = context.position - self.start + 1
        e = [self.expected[j] if j < len(self.expected) else 0 for j in range(i, i + 3)]
        wrong = [(x + 1) % 101 for x in e]
        # root children: wrong[0] (with a child), e[0]; e[0]'s children: wrong[1], e[1] -> e[2]
        tree = DraftTree([wrong[0], e[1], e[0], wrong[1], e[1], e[2]], [-1, 0, -1, 2, 2, 4])
        return DraftTree(tree.tokens[:k], tree.parents[:k])

    def observe(self, accepted: list[int]) -> None:
        pass


class Always:
    def __init__(self, name, k):
        self.name, self.k = name, k

    def plan(self, offers):
        return self.name, min(self.k, offers[self.name])

    def record(self, *args):
        pass


@pytest.mark.parametrize("head_dim", [64, 16])
def test_greedy_over_tree_rounds_equals_target_ar(head_dim):
    model = _model(head_dim)
    prompt = torch.randint(0, 101, (2 * head_dim - 5,), generator=_g(6)).tolist()
    expected, _ = _run(model, prompt, 40, "target-ar")
    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, len(prompt) + 48, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    stats = SpecStats()
    oracle = TreeOracle(expected, len(prompt))
    out = speculative_decode(
        runner, cache, logits, len(prompt), 40, SamplingParams(), _g(0), gamma="auto",
        planner=Always("oracle", 6), proposers=[oracle], stats=stats,
    )  # fmt: skip
    assert list(out) == expected and cache.seq_len == cache.committed
    assert stats.accepted >= 3 * (stats.rounds - 1)  # every round took e[0], e[1], e[2]


class TreePlanner(RandomPlanner):
    """RandomPlanner's rounds, and the document's tree whenever it offers one."""

    def plan(self, offers):
        if offers.get("tree") and int(torch.randint(0, 2, (1,), generator=self.gen)):
            return "tree", offers["tree"]
        return super().plan(offers)


def test_greedy_over_document_trees_equals_target_ar():
    """The document's own trees (one-token matches: several continuations each) mixed with
    every other kind of round."""
    model = _model(16)
    seed = torch.randint(0, 101, (6,), generator=_g(7)).tolist()
    said, _ = _run(model, seed, 20, "target-ar")
    prompt = seed + said + seed[:3] + [7, 8] + seed
    expected, _ = _run(model, prompt, 40, "target-ar")
    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, len(prompt) + 48, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    stats = SpecStats()
    out = speculative_decode(
        runner, cache, logits, len(prompt), 40, SamplingParams(), _g(0), gamma="auto",
        planner=TreePlanner(3), lookup=DocumentLookup(prompt, min_ngram=1), stats=stats,
    )  # fmt: skip
    assert list(out) == expected and cache.seq_len == cache.committed
    assert stats.source("tree").rounds >= 2 and stats.source("tree").accepted > 0


def test_sampled_tree_rounds_follow_the_target_path_distribution():
    """As test_lookup's mixed-rounds law test, with the document's trees among the rounds
    (V = 8, one-token matches): the second and third emitted tokens against their exact laws
    on the target path, n = 1200 seeded runs, TV bound 0.09 each (expected ~0.035)."""
    params = SamplingParams(temperature=1.0)
    model = _model(16, vocab=8)
    prompt = [0, 1, 2, 3, 1, 0, 3, 2, 1, 3]
    P = len(prompt)

    second, third = exact_laws(model, prompt, params)
    counts2, counts3, trees = torch.zeros(8), torch.zeros(8), 0
    runner = build_runner(model)
    for seed in range(1200):
        cache = HierarchicalKVCache(model.config, P + 12, dtype=torch.float32)
        logits = prefill_hierarchical(runner, cache, prompt)
        stats = SpecStats()
        out = list(
            speculative_decode(
                runner, cache, logits, P, 3, params, _g(seed), gamma="auto",
                planner=TreePlanner(seed + 10_000), lookup=DocumentLookup(prompt, min_ngram=1),
                stats=stats,
            )
        )  # fmt: skip
        counts2[out[1]] += 1
        counts3[out[2]] += 1
        trees += stats.source("tree").rounds
    assert trees > 200
    assert 0.5 * float((counts2 / 1200 - second).abs().sum()) < 0.09
    assert 0.5 * float((counts3 / 1200 - third).abs().sum()) < 0.09


def test_the_planner_prices_a_tree_by_its_measured_tokens():
    """A tree whose rounds accept nothing is priced out against plain steps; one whose rounds
    accept 3 tokens wins."""
    for accepted, expect in ((0, "draft"), (3, "tree")):
        planner = RoundPlanner(16)
        for _ in range(4):
            planner.record("draft", 2, 0, 0.02, 0.011, [0.01, 0.01])
            planner.record("draft", 0, 0, 0.0, 0.010)
        for _ in range(30):
            planner.record("tree", 8, accepted, 0.0, 0.016)
        source, k = planner.plan({"draft": 16, "lookup": 0, "tree": 8})
        assert source == expect and (k == 8 if expect == "tree" else k == 0)


def test_a_priced_tree_keeps_the_nodes_that_pay_for_their_rows():
    """One path: the chain the planner's own rule picks. Continuations that disagree: their
    branches where a verify row is cheap, none where it is dear."""
    from qspec_core.engine.planner import _best_length

    for a, slope in ((0.9, 0.05), (0.6, 0.1), (0.5, 0.4)):
        tree, expected = priced_tree([[1, 2, 3, 4, 5, 6, 7, 8]], a, 1.0, slope, 16)
        k, rate = _best_length(a, 0.0, lambda rows, b=slope: 1.0 + b * (rows - 1), 1, 8)
        assert tree.is_chain and len(tree) == k
        assert expected / (1.0 + slope * k) == pytest.approx(rate)
    paths = [[1, 2, 3], [4, 5, 6], [1, 7, 8]]
    cheap, _ = priced_tree(paths, 0.8, 1.0, 0.02, 16)
    assert cheap.tokens[:2] == [1, 2] and 4 in cheap.tokens and 7 in cheap.tokens
    dear, _ = priced_tree(paths, 0.8, 1.0, 0.3, 16)
    assert dear.is_chain and dear.tokens == [1, 2, 3][: len(dear)]
    assert len(priced_tree(paths, 0.8, 1.0, 0.02, 3)[0]) == 3


def test_a_tree_where_the_cache_cannot_verify_one_is_refused():
    """A proposer's tree over a cache whose attention is the reference (or any cache without
    the C++ tree mask) is an error, not a silently inexact round; the document's trees are
    simply not offered there."""
    model = _model(16)
    prompt = torch.randint(0, 101, (20,), generator=_g(8)).tolist()
    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, 64, dtype=torch.float32)
    cache.fused = False
    logits = prefill_hierarchical(runner, cache, prompt)
    oracle = TreeOracle([0] * 40, len(prompt))
    with pytest.raises(ValueError, match="token tree"):
        list(
            speculative_decode(
                runner, cache, logits, len(prompt), 8, SamplingParams(), _g(0), gamma="auto",
                planner=Always("oracle", 6), proposers=[oracle],
            )
        )  # fmt: skip
    assert cache.seq_len == cache.committed == len(prompt)
