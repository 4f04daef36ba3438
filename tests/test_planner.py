"""`--gamma auto` by cost (`engine/planner.py`): the choice each round makes from measured
step costs and acceptance, on synthetic measurements of the machines it must serve."""

import pytest

from qspec_core.engine.planner import (
    EXPLORE_EVERY,
    RETRY_FREE,
    START_GAMMA,
    RoundPlanner,
    expected_tokens,
)


def feed(planner, rounds, draft_s, verify_s, accept):
    """`rounds` rounds of each kind the planner may run, with step costs draft_s (seconds per
    draft step) and verify_s(m), and a fraction `accept` of each round's drafts accepted."""
    for _ in range(rounds):
        for source, k in (("draft", 4), ("draft", 0), ("lookup", 4), ("draft", 2)):
            n = round(accept[source] * k)
            planner.record(source, k, n, k * draft_s, verify_s(k + 1))


def offers(proposed: int) -> dict[str, int]:
    """What a round offers the planner: the 4-bit path any length, the lookup `proposed`."""
    return {"lookup": proposed, "draft": 15}


def test_an_unknown_source_is_planned_like_the_lookup():
    """A third proposer (`proposers.py`) is free but for the verify, with the lookup's prior
    until its own acceptance is measured: a good one wins the round, a bad one loses it."""
    planner = RoundPlanner(limit=15)
    feed(planner, 10, 0.1, lambda m: 1.0, {"draft": 0.5, "lookup": 0.5})
    for _ in range(10):
        planner.record("oracle", 4, 4, 0.0, 1.0)
    assert planner.plan({"draft": 15, "oracle": 6}) == ("oracle", 6)
    for _ in range(30):
        planner.record("oracle", 4, 0, 0.0, 1.0)
    planner.rounds_since_draft = 0  # (not yet time to explore the 4-bit path again)
    assert planner.plan({"draft": 15, "oracle": 6})[0] == "draft"


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5


def test_starts_by_timing_a_draft_round_and_explores_again_later():
    planner = RoundPlanner(limit=15)
    assert planner.plan(offers(6)) == ("draft", START_GAMMA)
    # a CPU where drafting loses at the acceptance measured (0.5), not at 0.1 more: after
    # timing it, plain steps and lookups only ...
    feed(planner, 3, 0.5, lambda m: 1 + 0.15 * (m - 1), {"draft": 0.5, "lookup": 0.0})
    choices = []
    for _ in range(EXPLORE_EVERY):
        choices.append(planner.plan(offers(0)))
        planner.record("draft", 0, 0, 0.0, 1.0)
    assert set(choices) == {("draft", 0)}
    # ... until a 4-bit round is tried again, since its acceptance may have moved
    source, k = planner.plan(offers(0))
    assert source == "draft" and k >= 1


def test_a_draft_that_cannot_win_is_not_tried_again():
    """A draft step at 0.9 of a target step: even at 0.1 more acceptance than measured it
    loses to plain steps, so the planner never spends a round re-timing it."""
    planner = RoundPlanner(limit=15)
    feed(planner, 3, 0.9, lambda m: 1 + 0.15 * (m - 1), {"draft": 0.7, "lookup": 0.0})
    for _ in range(4 * EXPLORE_EVERY):
        assert planner.plan(offers(0)) == ("draft", 0)
        planner.record("draft", 0, 0, 0.0, 1.0)
    assert planner.rounds_since_draft == 4 * EXPLORE_EVERY


def test_a_slow_draft_loses_to_plain_steps():
    """The 2-core dev CPU at 2k: a draft step 0.88 of a target step, a 5-row verify 1.7."""
    planner = RoundPlanner(limit=15)
    feed(planner, 10, 0.88, lambda m: 1 + 0.175 * (m - 1), {"draft": 0.7, "lookup": 0.0})
    assert planner.plan(offers(0)) == ("draft", 0)
    assert planner.plan(offers(4)) == ("draft", 0)  # lookups that were never accepted
    # a lookup that accepts one of four (one of the two tested) beats a plain step
    feed(planner, 10, 0.88, lambda m: 1 + 0.175 * (m - 1), {"draft": 0.7, "lookup": 0.25})
    assert planner.plan(offers(4))[0] == "lookup"


def test_a_cheap_draft_drafts_long():
    """A GPU-like machine: a draft step 0.1 of a verify whatever its rows, 90% accepted."""
    planner = RoundPlanner(limit=15)
    feed(planner, 5, 0.1, lambda m: 1.0, {"draft": 0.9, "lookup": 0.0})
    source, k = planner.plan(offers(0))
    assert source == "draft" and k >= 6


def test_a_good_lookup_wins_over_drafting():
    """A summary that copies the document: lookups accepted 90% of the time beat 4-bit
    drafts at the same acceptance, since they skip the draft steps."""
    planner = RoundPlanner(limit=15)
    feed(planner, 5, 0.3, lambda m: 1 + 0.05 * (m - 1), {"draft": 0.75, "lookup": 0.75})
    source, k = planner.plan(offers(6))
    assert source == "lookup" and k == 6
    assert planner.plan(offers(0))[0] == "draft"


def test_verify_cost_is_a_line_through_the_row_counts_timed():
    planner = RoundPlanner(limit=15)
    assert planner.verify_seconds(3) is None
    planner.record("draft", 4, 2, 0.4, 2.0)  # v(5) = 2.0 alone: the prior's slope
    assert planner.verify_seconds(1) == pytest.approx(2.0 / 1.4)
    planner.record("draft", 0, 0, 0.0, 1.0)  # v(1) = 1.0: now a line through both
    assert planner.verify_seconds(3) == pytest.approx(1.5)
    assert planner.verify_seconds(9) == pytest.approx(3.0)


def test_one_slow_verify_does_not_tilt_the_line():
    """Plain steps at 8 ms and verifies of 2-6 rows at 8 + 0.8 (m - 1) ms, then one 7-row
    verify at 24 ms (a preemption): a least-squares line put v(1) at 6 ms and the slope at
    2 ms a row, and a lookup at 27% acceptance then lost to plain steps for the rest of the
    answer. Anchored at v(1) with the median slope, the line stays where the rows put it."""
    planner = RoundPlanner(limit=15)
    planner.record("draft", 2, 0, 0.014, 0.0096, [0.007, 0.007])
    for _ in range(20):
        planner.record("draft", 0, 0, 0.0, 0.008)
    for k in range(1, 6):
        planner.record("lookup", k, 0, 0.0, 0.008 + 0.0008 * k)
    planner.record("lookup", 6, 1, 0.0, 0.024)
    assert planner.verify_seconds(1) == pytest.approx(0.008)
    assert planner.verify_seconds(3) == pytest.approx(0.0096)
    for _ in range(3):  # a few good lookups after the poor ones
        planner.record("lookup", 2, 2, 0.0, 0.0088)
    assert planner.plan({"lookup": 4, "draft": 15})[0] == "lookup"


def test_a_lookup_priced_out_is_tried_again_for_one_token():
    """Lookups at 10% acceptance lose to plain steps; after RETRY_FREE offers passed over,
    one token is tried (a 2-row verify), and once it is accepted often they win again."""
    planner = RoundPlanner(limit=15)
    planner.record("draft", 2, 0, 0.014, 0.0112, [0.008, 0.008])
    for _ in range(10):  # each verify row 20% of a plain step
        planner.record("draft", 0, 0, 0.0, 0.008)
        planner.record("lookup", 4, 0, 0.0, 0.0144)
    plans = [planner.plan(offers(4)) for _ in range(RETRY_FREE + 1)]
    assert plans[:RETRY_FREE] == [("draft", 0)] * RETRY_FREE
    assert plans[-1] == ("lookup", 1)
    assert planner.plan(offers(0)) == ("draft", 0)  # (nothing offered: nothing counted)
    for _ in range(8):
        planner.record("lookup", 1, 1, 0.0, 0.0088)
    assert planner.plan(offers(4))[0] == "lookup"


def test_no_lookup_retry_displaces_a_draft_that_pays():
    """Where the 4-bit path wins (a cheap draft, 90% accepted), a lookup that loses is not
    forced in every RETRY_FREE rounds: the retry is priced against plain steps only."""
    planner = RoundPlanner(limit=15)
    feed(planner, 3, 0.1, lambda m: 1.0, {"draft": 0.9, "lookup": 0.0})
    plans = [planner.plan(offers(4)) for _ in range(3 * RETRY_FREE)]
    assert all(source == "draft" and k >= 1 for source, k in plans)


def test_a_plain_step_is_timed_before_drafting_is_priced_against_it():
    """Steps like the Zen 4's at 8k (there a draft step cost 0.85 of a target step and an
    extra verify row about half of one; here 0.7 and 0.45). From the timing round alone
    (v(3) = 1.9 and the prior slope) a plain step looked 1.58 and 1-token drafts won: on the
    Zen 4 the old planner took one plain step in 31 rounds and decoded at 0.85x of target-ar.
    A plain step is timed first, and drafting then loses to it."""
    planner = RoundPlanner(limit=15)
    assert planner.plan(offers(0)) == ("draft", START_GAMMA)
    planner.record("draft", 2, 2, 1.4, 1.9, [0.7, 0.7])
    assert planner.plan(offers(0)) == ("draft", 0)
    assert planner.plan(offers(4)) == ("draft", 0)  # (a lookup waits for the baseline too)
    planner.record("draft", 0, 0, 0.0, 1.0)
    assert planner.verify_seconds(1) == pytest.approx(1.0)
    for _ in range(3):
        assert planner.plan(offers(0)) == ("draft", 0)
        planner.record("draft", 0, 0, 0.0, 1.0)


def test_a_slow_first_round_is_forgotten():
    """The first 4-bit round pays for lazy weight packing (or kernel compilation on a GPU):
    100 s a step here. It must not keep the planner from drafting once steps are cheap."""
    planner = RoundPlanner(limit=15)
    planner.record("draft", 4, 4, 400.0, 1.0)
    assert planner.plan(offers(0)) == ("draft", START_GAMMA)  # a second timing first
    feed(planner, 2, 0.1, lambda m: 1.0, {"draft": 0.9, "lookup": 0.0})
    source, k = planner.plan(offers(0))
    assert source == "draft" and k >= 6


def test_one_round_with_step_timings_ends_the_start():
    """`SelfDraft.step_seconds` gives each step's time: one START round's two steps are two
    timings, the cold first one (100 s here) the upper and so not the one used."""
    planner = RoundPlanner(limit=15)
    planner.record("draft", 2, 2, 100.1, 1.0, [100.0, 0.1])
    planner.record("draft", 0, 0, 0.0, 1.0)
    assert planner.draft_step.value == pytest.approx(0.1)
    source, k = planner.plan(offers(0))
    assert source == "draft" and k >= 1  # (cheap steps, all accepted: no second start round)


def test_a_later_decode_starts_from_the_timings_of_an_earlier_one():
    """`StepCosts` (the runtime's): where an earlier decode near this context measured that
    drafting loses, the next decode spends no round timing it; far from it (beyond a factor
    of 2 in context), it times the 4-bit path again. Acceptance is not carried over."""
    from qspec_core.timing import StepCosts

    costs = StepCosts()
    first = RoundPlanner.from_costs(15, costs, 4000)
    assert first.plan(offers(0)) == ("draft", START_GAMMA)
    feed(first, 3, 0.9, lambda m: 1 + 0.15 * (m - 1), {"draft": 0.7, "lookup": 0.0})
    first.keep(costs, 4000)
    later = RoundPlanner.from_costs(15, costs, 6000)
    assert later.plan(offers(0)) == ("draft", 0)
    assert later.draft_step.value == pytest.approx(0.9) and not later.tested
    assert RoundPlanner.from_costs(15, costs, 9000).plan(offers(0)) == ("draft", START_GAMMA)
    never_drafted = RoundPlanner(limit=15)  # (stopped at once, or lookups only): nothing kept
    never_drafted.record("lookup", 4, 4, 0.0, 1.0)
    never_drafted.keep(costs, 6000)
    assert 6000 not in costs.by_context
