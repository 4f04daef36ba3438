"""Drafts from the document (`engine/lookup.py`): the index against a brute-force search, the
point-mass verifier's law, and speculative decoding with lookup rounds mixed with 4-bit rounds:
greedy equality, sampling law, the committed cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speculative import _echo_prompt, _forced, _g, _model, assert_replays

from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.generate import prefill_hierarchical
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.sampling import SamplingParams, probabilities
from qspec_core.engine.speculative import SpecStats, speculative_decode
from qspec_core.engine.verify import residual_distribution, verify_sampling
from qspec_core.precision import TARGET
from qspec_core.runner import build_runner


def brute_force(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix of n in [lo, hi] tokens that also ends earlier (with a token after
    it); of its occurrences the latest; the k tokens from there, the sequence extended by
    copying as it goes."""
    for n in range(min(hi, len(seq)), lo - 1, -1):
        suffix = seq[len(seq) - n :]
        for at in range(len(seq) - 1, n - 1, -1):  # seq[at] follows the occurrence
            if seq[at - n : at] == suffix:
                longer = list(seq)  # copying on past the end copies the copy
                while len(longer) < at + k:
                    longer.append(longer[len(longer) - len(seq) + at])
                return longer[at : at + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 4),
    split=st.integers(0, 40),
)
def test_proposals_equal_a_brute_force_search(seq, k, lo, extra, split):
    """Built at once or grown in two parts, the index proposes what the search finds."""
    hi = lo + extra
    whole = DocumentLookup(seq, lo, hi)
    grown = DocumentLookup(seq[:split], lo, hi)
    grown.extend(seq[split:])
    expected = brute_force(seq, k, lo, hi)
    assert whole.propose(k) == expected
    assert grown.propose(k) == expected
    assert len(whole) == len(seq)


def test_lookup_examples():
    index = DocumentLookup([5, 6, 7, 8, 9, 1, 5, 6, 7], min_ngram=3)
    assert index.propose(4) == [8, 9, 1, 5]  # "5 6 7" occurred at the start
    assert index.propose(8) == [8, 9, 1, 5, 6, 7, 8, 9]  # and copying goes on past the end
    index.extend([2])
    assert index.propose(4) == []  # "6 7 2" never did
    index = DocumentLookup([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], min_ngram=2)
    assert index.propose(2) == [9, 1]  # the latest occurrence wins
    assert DocumentLookup([1, 2, 3], min_ngram=3).propose(4) == []  # never itself
    assert DocumentLookup([7, 7, 7], min_ngram=2).propose(3) == [7, 7, 7]  # a loop
    with pytest.raises(ValueError):
        DocumentLookup([], min_ngram=3, max_ngram=2)


def test_point_mass_rejection_law_by_enumeration():
    """q = 1[x]: P(emit y) = 1[y = x] p(x) + (1 - p(x)) residual(y) must equal p(y), for x in
    and out of p's support."""
    g = _g(6)
    for _ in range(20):
        p = torch.rand(6, generator=g) ** 3
        p[int(torch.randint(0, 6, (1,), generator=g))] = 0.0  # a token p never emits
        p /= p.sum()
        for x in range(6):
            q = torch.zeros(6)
            q[x] = 1.0
            emitted = q * p[x] + (1 - p[x]) * residual_distribution(p, q)
            torch.testing.assert_close(emitted, p, atol=1e-6, rtol=1e-5)


def test_point_mass_verify_frequencies_follow_the_target():
    """Two proposed tokens [1, 4] against p; 40000 rounds; the first emitted token ~ p_1
    (std <= 0.0025 per frequency, bound 0.012)."""
    p = torch.tensor(
        [[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1, 0.6]]
    )
    drafts = torch.tensor([1, 4])
    q = torch.zeros(2, 5)
    q[torch.arange(2), drafts] = 1.0
    g = _g(7)
    counts = torch.zeros(5)
    for _ in range(40000):
        n, nxt = verify_sampling(drafts, q, p, g)
        counts[1 if n >= 1 else nxt] += 1
    assert (counts / 40000 - p[0]).abs().max() < 0.012


def _run_lookup(model, prompt, n_new, params=SamplingParams(), seed=0, lookup_min=3, **kw):
    runner = build_runner(model)  # (as `_run`: the C++ kernels where built)
    cache = HierarchicalKVCache(model.config, len(prompt) + n_new + 8, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    index = DocumentLookup(prompt, min_ngram=lookup_min)
    stats = kw.pop("stats", SpecStats())
    out = speculative_decode(
        runner, cache, logits, len(prompt), n_new, params, _g(seed), lookup=index, stats=stats, **kw
    )
    return list(out), cache, stats


@pytest.mark.parametrize("gamma", [1, 4, "auto"])
def test_greedy_with_lookup_equals_target_ar(gamma):
    """A prompt that holds the model's own continuation of its end once already: rounds from
    the document and from the 4-bit path, both accepting and rejecting, and rotations; the
    output is target-ar's, token for token."""
    model = _model()
    prompt, expected = _echo_prompt(model)
    got, cache, stats = _run_lookup(model, prompt, 70, gamma=gamma, lookup_min=2)
    assert got == expected
    assert cache.quantized_len >= 48 and cache.seq_len == cache.committed
    from_document = stats.source("lookup").drafted + stats.source("tree").drafted
    assert stats.drafted == stats.draft_steps + from_document
    restored = SpecStats.from_dict(stats.to_dict(gamma))
    assert restored.to_dict(gamma) == stats.to_dict(gamma)
    if gamma == "auto":
        return  # (what the planner picks here depends on this machine's timings)
    src = stats.sources()
    assert src["lookup"]["rounds"] > 0 and src["draft"]["rounds"] > 0  # mixed rounds
    assert 0 < src["lookup"]["accepted"] < src["lookup"]["drafted"]  # accepted and rejected


class RandomPlanner:
    """Each round a plain target step, 1-3 drafts on the 4-bit path, or the lookup's proposal,
    at random from its own generator: rounds of every kind, mixed, and a choice that depends
    on nothing the round draws (as the real planner's choice depends only on the past)."""

    def __init__(self, seed):
        self.gen = _g(seed)

    def plan(self, offers):
        proposed = offers.get("lookup", 0)
        pick = int(torch.randint(0, 8, (1,), generator=self.gen))
        if pick >= 4 and proposed:
            return "lookup", min(proposed, pick - 3)
        return "draft", min(pick, 3)

    def record(self, *args):
        pass


def test_greedy_equals_target_ar_over_every_kind_of_round():
    model = _model()
    prompt, expected = _echo_prompt(model)
    got, cache, stats = _run_lookup(
        model, prompt, 70, gamma="auto", lookup_min=1, planner=RandomPlanner(0)
    )
    assert got == expected and cache.seq_len == cache.committed
    src = stats.sources()
    assert min(src[kind]["rounds"] for kind in ("draft", "lookup", "none")) > 3
    assert 0 < src["lookup"]["accepted"] < src["lookup"]["drafted"]


def exact_laws(model, prompt: list[int], params) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact laws [V] of the second and third tokens emitted after `prompt` on the target
    path (the first sampled from the prefill's logits), enumerated over a small vocabulary."""
    P, V = len(prompt), model.config.vocab_size

    def next_law(tokens: list[int]) -> torch.Tensor:
        c = HierarchicalKVCache(model.config, P + 8, dtype=torch.float32)
        logits = prefill_hierarchical(model, c, prompt)
        with torch.no_grad():
            for i, t in enumerate(tokens):
                logits = model(torch.tensor([[t]]), torch.tensor([P + i]), c, TARGET)[0, -1]
                c.commit(P + i + 1)
        return probabilities(logits, params)

    first = next_law([])
    second, third = torch.zeros(V), torch.zeros(V)
    for x in range(V):
        law_x = next_law([x])
        second += first[x] * law_x
        for y in range(V):
            third += first[x] * law_x[y] * next_law([x, y])
    return second, third


def test_sampled_mixed_rounds_follow_the_target_path_distribution():
    """V = 8, a prompt with tokens 0-3 only and one-token matches: a pending token in 0-3 can
    draft from the prompt; rounds are plain steps, 4-bit drafts or lookups at random. The
    laws of the second and third emitted tokens against their exact laws on the target path
    (enumerated), n = 1500 seeded runs, TV bound 0.08 each (expected ~0.03)."""
    params = SamplingParams(temperature=1.0)
    model = _model(vocab=8)
    prompt = [0, 1, 2, 3, 1, 0, 3, 2]
    second, third = exact_laws(model, prompt, params)
    counts2, counts3 = torch.zeros(8), torch.zeros(8)
    sources = SpecStats()
    for seed in range(1500):
        stats = SpecStats()
        out, _, _ = _run_lookup(
            model, prompt, 3, params, seed, lookup_min=1, gamma="auto", stats=stats,
            planner=RandomPlanner(seed + 10_000),
        )  # fmt: skip
        counts2[out[1]] += 1
        counts3[out[2]] += 1
        sources.add(stats)
    assert min(source["rounds"] for source in sources.sources().values()) > 200
    assert 0.5 * float((counts2 / 1500 - second).abs().sum()) < 0.08
    assert 0.5 * float((counts3 / 1500 - third).abs().sum()) < 0.08


@pytest.mark.parametrize("pattern", [[0] * 12, [4] * 12, [0, 4, 1, 4, 3, 0, 4, 2] * 2])
def test_lookup_rounds_leave_exactly_the_committed_kv(pattern):
    """Forced acceptance over lookup and 4-bit rounds, F2 near full: the cache's next logits
    equal a target-path replay of the committed tokens (1e-5)."""
    model = _model()
    G = model.config.head_dim
    phrase = torch.randint(0, 101, (9,), generator=_g(9)).tolist()
    prompt = (phrase * 4)[: 2 * G - 3]
    out, cache, stats = _run_lookup(model, prompt, 40, lookup_min=2, verifier=_forced(pattern))
    assert stats.by_source["lookup"].rounds > 0
    assert_replays(model, prompt, out, cache)


def test_a_phrase_repeated_many_times_takes_the_vectorized_search():
    """Past MANY candidates the matches are extended all at once: the same answer."""
    from qspec_core.engine import lookup

    seq = []
    for i in range(3 * lookup.MANY):  # "7 8 9 <i % 5> <i % 3>", a phrase with varied tails
        seq += [7, 8, 9, 100 + i % 5, 200 + i % 3]
    seq += [1, 200 + 1, 7, 8, 9]
    index = DocumentLookup(seq)
    assert index.propose(3) == brute_force(seq, 3, 3, 8)
    assert index._latest_longest_few  # (the small path is the brute force test's)
