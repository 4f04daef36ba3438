"""Multi-turn sessions reuse the cached prefix and stay exact after interruptions."""

import pytest
import torch

from qspec_core.cache.hierarchical import K_GROUPED, PLANE_BUFFERS
from qspec_core.engine.session import ChatSession
from qspec_core.errors import QspecError
from qspec_core.registry.runtime import load_runtime

DOC = "The lighthouse keeper counted 41 ships in March and 17 in April. " * 3


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None)


def _answer(session, question):
    return "".join(session.ask(question))


MODES = ["quantspec", "target-ar", "ar"]


@pytest.mark.parametrize("mode", MODES)
def test_follow_up_prefills_only_new_tokens_and_matches_a_fresh_session(tiny, mode):
    session = ChatSession(tiny, DOC, max_new_tokens=12, mode=mode)
    _answer(session, "How many ships?")
    first = session.last
    assert first.prefilled_tokens == first.prompt_tokens
    second_text = _answer(session, "And in April?")
    second = session.last
    assert second.prefilled_tokens < second.prompt_tokens - first.prompt_tokens + 8

    fresh = ChatSession(tiny, DOC, max_new_tokens=12, mode=mode)
    fresh.history = list(session.history[:2])
    assert _answer(fresh, "And in April?") == second_text
    assert fresh.last.prefilled_tokens == fresh.last.prompt_tokens


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_reply_leaves_no_trace(tiny, mode):
    """Ctrl-C mid-answer: the next answer is what it would have been without the cancelled
    question (same seed, same generator state are not assumed: greedy)."""
    session = ChatSession(tiny, DOC, max_new_tokens=20, mode=mode)
    _answer(session, "How many ships?")
    reply = session.ask("Tell me everything.")
    for _ in range(3):
        next(reply)
    reply.close()  # what Ctrl-C does in the CLI
    assert session.last.new_tokens >= 3 and len(session.history) == 2
    follow = _answer(session, "Anything else?")

    fresh = ChatSession(tiny, DOC, max_new_tokens=20, mode=mode)
    _answer(fresh, "How many ships?")
    assert _answer(fresh, "Anything else?") == follow


def test_quantspec_session_equals_target_ar_and_reports_acceptance(tiny):
    spec = ChatSession(tiny, DOC, max_new_tokens=30, mode="quantspec", gamma=3)
    target = ChatSession(tiny, DOC, max_new_tokens=30, mode="target-ar")
    assert _answer(spec, "Summarize.") == _answer(target, "Summarize.")
    stats = spec.last.spec
    # a fixed gamma: every round drafts 3, but the last one may stop at max_new_tokens
    assert stats.rounds > 0 and (stats.rounds - 1) * 3 < stats.drafted <= stats.rounds * 3
    assert stats.accepted + stats.recovered + stats.bonus + 1 >= spec.last.new_tokens
    assert {"draft", "verify", "accept", "rollback"} <= set(spec.last.timings_s)


def test_reset_keeps_the_document_cached(tiny):
    session = ChatSession(tiny, DOC, max_new_tokens=4, mode="ar")
    _answer(session, "Hi")
    session.reset()
    _answer(session, "Hi again")
    assert session.last.prefilled_tokens < 20 and session.turns == 1


def test_too_long_is_refused_with_lengths_and_truncation_fits(tiny):
    long_doc = DOC * 20  # > 512 tokens, the tiny model's context
    with pytest.raises(QspecError, match=r"document is \d+ tokens.*context is 512 tokens") as e:
        _answer(ChatSession(tiny, long_doc, max_new_tokens=8), "Summarize.")
    # (the advice: what helps a first question; /reset only once turns take room)
    assert str(e.value).endswith("Use --truncate to keep the start of the document")
    chat = ChatSession(tiny, DOC, max_new_tokens=8)
    _answer(chat, "Summarize.")
    with pytest.raises(QspecError, match=r"Use a shorter question$"):
        _answer(chat, "Say more. " * 300)
    fresh = len(ChatSession(tiny, DOC).prompt_ids("Say more."))
    chat.max_new_tokens = 512 - fresh  # (what the first turn takes is what is missing)
    with pytest.raises(QspecError, match=r"--max-new-tokens \d+ or less or /reset the conv"):
        _answer(chat, "Say more.")
    session = ChatSession(tiny, long_doc, max_new_tokens=8, truncate=True)
    assert session.truncated_tokens > 0
    _answer(session, "Summarize the document above.")
    assert session.last.prompt_tokens + 8 <= 512


@pytest.mark.parametrize("mode", ["quantspec", "target-ar"])
@pytest.mark.parametrize("how", ["reset", "cancel"])
def test_document_kv_survives_answers_quantized_past_it(tiny, mode, how):
    """An answer long enough to push quantization past the document's end, then /reset (or
    a question after a cancelled answer): the document is not prefilled again, and the next
    answer is a fresh session's."""
    session = ChatSession(tiny, DOC, max_new_tokens=80, mode=mode)
    doc_len = len(session.document_prefix_ids())
    reply = session.ask("Tell me everything, at length.")
    if how == "cancel":
        for _ in range(70):
            next(reply)
        reply.close()
    else:
        for _ in reply:
            pass
        session.reset()
    assert session.last.new_tokens >= 64
    assert max(session._cache.n_quant) > doc_len  # the answer reached the planes
    follow = _answer(session, "How many ships?")
    assert session.last.prefilled_tokens == session.last.prompt_tokens - doc_len

    fresh = ChatSession(tiny, DOC, max_new_tokens=80, mode=mode)
    assert _answer(fresh, "How many ships?") == follow


def test_gamma_auto_with_a_small_group_size_stays_below_it(tiny):
    """--gamma auto starts at 4 drafts, or below G when G is smaller (a verify of gamma + 1
    tokens must fit the G slots of slack); greedy output still equals target-ar's."""
    spec = ChatSession(tiny, DOC, max_new_tokens=24, mode="quantspec", gamma="auto", group_size=4)
    target = ChatSession(tiny, DOC, max_new_tokens=24, mode="target-ar", group_size=4)
    assert _answer(spec, "Summarize.") == _answer(target, "Summarize.")
    assert spec.last.spec.rounds > 0


def test_a_second_answer_starts_from_the_runtime_step_timings(tiny):
    """A quantspec answer leaves its step timings on the runtime (`StepCosts`); the next
    answer's `--gamma auto` starts from them (no timing round) and stays exact."""
    tiny.costs.by_context.clear()
    spec = ChatSession(tiny, DOC, max_new_tokens=24, mode="quantspec")
    first = _answer(spec, "Summarize.")
    assert len(tiny.costs.by_context) == 1
    (context,) = tiny.costs.by_context
    draft, verify = tiny.costs.by_context[context]
    assert len(draft) >= 2 and verify
    again = ChatSession(tiny, DOC, max_new_tokens=24, mode="quantspec")
    target = ChatSession(tiny, DOC, max_new_tokens=24, mode="target-ar")
    assert _answer(again, "Summarize.") == first == _answer(target, "Summarize.")


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_grown_turn_by_turn_answers_as_one_made_at_the_whole_context(tiny, mode):
    """A session's cache holds what its first question needs and grows after (a preallocated
    128k context would be gigabytes at 8B): the planes, their scales, the staged slot and the
    C++ cache over them must carry over, or a later answer changes."""
    # a fixed gamma: --gamma auto's timed choices may move a few lower-plane codes (see below)
    grown = ChatSession(tiny, DOC, max_new_tokens=24, mode=mode, gamma=3)
    whole = ChatSession(
        tiny, DOC, max_new_tokens=24, mode=mode, gamma=3, capacity=tiny.context_limit
    )
    sizes = []
    for question in ("How many ships?", "And in April?", "Say it again, longer."):
        assert _answer(grown, question) == _answer(whole, question)
        sizes.append(grown._cache.max_seq_len)
        if mode != "ar":  # the history both have quantized: every plane and scale, bit for bit
            ours, theirs = grown._cache.state(), whole._cache.state()  # (rotation is lazy)
            n = min(ours["k_upper"].shape[3], theirs["k_upper"].shape[3])
            assert n > 0  # (history was quantized before it grew)
            for name in PLANE_BUFFERS:
                m = n // grown._cache.group_size if name in K_GROUPED else n
                assert torch.equal(ours[name][:, :, :, :m], theirs[name][:, :, :, :m]), name
    assert sizes[0] < sizes[-1] < tiny.context_limit == whole._cache.max_seq_len


def test_the_advice_for_too_long_is_only_what_would_help(tiny):
    """--truncate only where cutting the document would make it fit and the document can be
    cut (not a snapshot's); a shorter question where the question is what overflows."""
    huge = 10**12
    with pytest.raises(QspecError) as e:
        _answer(ChatSession(tiny, DOC, max_new_tokens=huge, mode="target-ar"), "Summarize.")
    assert str(e.value).endswith("or less") and "--truncate" not in str(e.value)
    prefilled = ChatSession(tiny, DOC, mode="target-ar")
    cache, ids = prefilled.prefill_document()
    snapshot = ChatSession(tiny, DOC, max_new_tokens=400, mode="target-ar")
    snapshot.adopt_cache(cache, ids)  # (what `qspec chat doc.qspec` does)
    with pytest.raises(QspecError) as e:
        _answer(snapshot, "Summarize. " * 40)
    message = str(e.value)
    assert "--truncate" not in message and "a shorter question" in message
    with pytest.raises(QspecError, match="Use a shorter question$"):
        _answer(ChatSession(tiny, DOC, max_new_tokens=8, mode="target-ar"), "Why? " * 600)


def test_a_document_far_too_long_is_refused_before_it_is_tokenized(tiny, monkeypatch):
    """10 MB of one repeated character took 105 s and 2.1 GB to tokenize before the refusal:
    its bytes bound its tokens from below (no token stands for more bytes than the longest
    one in the vocabulary), so it is refused first."""
    tok = tiny.tokenizer
    huge = "a" * 4_000_000
    assert tok.min_tokens(huge) <= len(tok.encode("a" * 100_000)) * 40  # (a true lower bound)

    def encode(text):
        raise AssertionError("the whole document was tokenized")

    monkeypatch.setattr(tok, "encode", encode)
    with pytest.raises(QspecError, match=r"the document is at least \d+ tokens.*context is 512"):
        ChatSession(tiny, huge, max_new_tokens=8)
