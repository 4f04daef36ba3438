"""Draft sources as `Proposer`s (`engine/proposers.py`): a third one plugs into the round, and
the stats keep one entry per source in the same JSON as before; one decode plan per mode
(`engine/plan.py`)."""

import json

import pytest
import torch
from test_speculative import _echo_prompt, _g, _model, _run

from qspec_core.bench.runner import BenchConfig
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.generate import prefill_hierarchical
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.plan import DecodePlan
from qspec_core.engine.proposers import (
    DocumentDraft,
    DocumentTree,
    DraftSource,
    RoundContext,
    SelfDraft,
)
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats, speculative_decode
from qspec_core.engine.tree import DraftTree
from qspec_core.precision import DRAFT, DRAFT_KV4, DRAFT_W4, FP, TARGET
from qspec_core.runner import build_runner


class Oracle:
    """Proposes target-ar's own continuation (known in advance), with every `wrong`-th
    proposed token replaced by a wrong one: rounds that accept all and rounds that reject."""

    name = "oracle"

    def __init__(self, expected: list[int], start: int, wrong: int):
        self.expected, self.start, self.wrong = expected, start, wrong
        self.observed: list[int] = []
        self.proposed = 0

    def offer(self, k: int) -> int:
        return k

    def propose(self, context: RoundContext, k: int):
        # the pending token is expected[i - 1]: drafts follow it at i, i + 1, ...
        i = context.position - self.start + 1
        assert self.expected[i - 1] == context.pending
        tokens = []
        for j in range(i, i + k):
            self.proposed += 1
            token = self.expected[j] if j < len(self.expected) else 0
            tokens.append((token + 1) % 101 if self.proposed % self.wrong == 0 else token)
        return DraftTree.chain(tokens)

    def observe(self, accepted: list[int]) -> None:
        self.observed += accepted


def _decode(model, prompt, n_new, **kw):
    runner = build_runner(model)  # (as `_run`: the C++ kernels where built)
    cache = HierarchicalKVCache(model.config, len(prompt) + n_new + 8, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    stats = SpecStats()
    out = speculative_decode(
        runner, cache, logits, len(prompt), n_new, SamplingParams(), _g(0), stats=stats, **kw
    )
    return list(out), cache, stats


@pytest.mark.parametrize("gamma", [1, 5])
def test_a_third_proposer_drafts_every_round_under_its_own_name(gamma):
    """Asked first with a fixed gamma, it drafts every round; output stays target-ar's; every
    emitted token is observed, in order; its rounds are counted under "oracle"."""
    model = _model()
    prompt = torch.randint(0, 101, (21,), generator=_g(3)).tolist()
    expected, _ = _run(model, prompt, 50, "target-ar")
    oracle = Oracle(expected, len(prompt), wrong=7)
    got, cache, stats = _decode(model, prompt, 50, gamma=gamma, proposers=[oracle])
    assert got == expected and cache.seq_len == cache.committed
    assert expected[: len(oracle.observed)] == oracle.observed  # (the last round's come later)
    src = stats.to_dict(gamma)["sources"]
    assert list(src) == ["draft", "lookup", "none", "oracle"]
    assert src["oracle"]["rounds"] == stats.rounds and src["draft"]["rounds"] == 0
    assert 0 < src["oracle"]["accepted"] < src["oracle"]["drafted"] == stats.drafted
    assert stats.draft_steps == 0  # no forward pass on the draft path
    assert SpecStats.from_dict(stats.to_dict(gamma)).to_dict(gamma) == stats.to_dict(gamma)


class Scripted:
    """Picks each round's source at random among those offering tokens, plain steps too."""

    def __init__(self, seed):
        self.gen = _g(seed)

    def plan(self, offers):
        names = [name for name, most in offers.items() if most]
        name = names[int(torch.randint(0, len(names), (1,), generator=self.gen))]
        k = int(torch.randint(0 if name == "draft" else 1, 4, (1,), generator=self.gen))
        return name, min(k, offers[name])

    def record(self, *args):
        pass


def test_greedy_over_three_sources_and_plain_steps_equals_target_ar():
    model = _model()
    prompt, expected = _echo_prompt(model)
    oracle = Oracle(expected, len(prompt), wrong=3)
    got, cache, stats = _decode(
        model, prompt, 70, gamma="auto", planner=Scripted(1), proposers=[oracle],
        lookup=DocumentLookup(prompt, min_ngram=1),
    )  # fmt: skip
    assert got == expected and cache.seq_len == cache.committed
    src = stats.sources()
    assert min(s["rounds"] for s in src.values()) > 2
    assert sum(s["rounds"] for s in src.values()) == stats.rounds
    assert sum(s["drafted"] for s in src.values()) == stats.drafted
    assert sum(s["accepted"] for s in src.values()) == stats.accepted


def test_stats_json_is_unchanged_and_round_trips():
    """The dict of `to_dict`, key for key as the bench JSON, batch records and snapshots have
    it: totals, then per source (the three built-in ones always listed)."""
    stats = SpecStats()
    for source, g, n in (("draft", 4, 2), ("lookup", 3, 3), ("draft", 0, 0), ("draft", 4, 4)):
        stats.count(source, g, n)
    d = stats.to_dict("auto")
    assert d == {
        "acceptance_rate": round(9 / 11, 4),
        "tokens_per_target_step": 3.25,
        "gamma": "auto",
        "rounds": 4,
        "drafted": 11,
        "accepted": 9,
        "recovered": 1,
        "bonus": 3,
        "accepted_hist": [1, 0, 1, 1, 1],
        "draft_steps": 8,
        "sources": {
            "draft": {"rounds": 2, "drafted": 8, "accepted": 6, "acceptance_rate": 0.75},
            "lookup": {"rounds": 1, "drafted": 3, "accepted": 3, "acceptance_rate": 1.0},
            "none": {"rounds": 1, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0},
        },
    }
    restored = SpecStats.from_dict(json.loads(json.dumps(d)))
    assert restored.to_dict("auto") == d
    other = SpecStats()
    other.count("oracle", 2, 1)
    restored.add(other)
    assert restored.sources()["oracle"]["rounds"] == 1 and restored.rounds == 5
    assert restored.sources()["draft"] == d["sources"]["draft"]
    assert SpecStats().to_dict(4)["sources"].keys() == {"draft", "lookup", "none"}


def test_the_shipped_sources_are_named_by_their_strings():
    """`DraftSource` members are the strings the reports, and keys read back, hold."""
    names = [p.name for p in (SelfDraft, DocumentDraft, DocumentTree)]
    assert names == ["draft", "lookup", "tree"] and set(DraftSource) >= set(names)
    stats = SpecStats()
    stats.count(DraftSource.TREE, 3, 2, bonus=False)
    text = json.dumps(stats.to_dict(4))
    assert '"sources": {"draft": {' in text and '"none": {' in text and '"tree": {' in text
    assert f"{DraftSource.DRAFT}, {DraftSource.TREE!s}" == "draft, tree"


def test_one_decode_plan_for_the_bench_and_sessions():
    """Each bench mode's plan (`BenchConfig.plan`): its paths, gamma and lookup."""
    config = BenchConfig([2048], gamma="auto", target_weights="int8", lookup=True)
    assert config.plan("ar") == DecodePlan(FP.with_weights("int8"))
    assert not config.plan("target-ar").speculative
    assert config.plan("quantspec") == DecodePlan(TARGET.with_weights("int8"), DRAFT, "auto", True)
    assert config.plan("quantspec-g4") == DecodePlan(TARGET.with_weights("int8"), DRAFT, 4, False)
    # a draft on full weights takes the target's weight set
    assert config.plan("draft-kv4").draft == DRAFT_KV4.with_weights("int8")
    assert config.plan("draft-w4").draft == DRAFT_W4
    model = _model()
    assert isinstance(config.plan("ar").new_cache(model, 64), FullPrecisionCache)
    assert isinstance(config.plan("quantspec").new_cache(model, 64), HierarchicalKVCache)
