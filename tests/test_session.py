"""Multi-turn sessions reuse the cached prefix and stay exact after interruptions."""

import pytest

from qspec_core.errors import QspecError
from qspec_core.runtime import load_runtime
from qspec_core.session import ChatSession

DOC = "The lighthouse keeper counted 41 ships in March and 17 in April. " * 3


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None)


def _answer(session, question):
    return "".join(session.ask(question))


def test_follow_up_prefills_only_new_tokens_and_matches_a_fresh_session(tiny):
    session = ChatSession(tiny, DOC, max_new_tokens=12)
    _answer(session, "How many ships?")
    first = session.last
    assert first.prefilled_tokens == first.prompt_tokens
    second_text = _answer(session, "And in April?")
    second = session.last
    assert second.prefilled_tokens < second.prompt_tokens - first.prompt_tokens + 8

    fresh = ChatSession(tiny, DOC, max_new_tokens=12)
    fresh.history = list(session.history[:2])
    assert _answer(fresh, "And in April?") == second_text
    assert fresh.last.prefilled_tokens == fresh.last.prompt_tokens


def test_interrupted_reply_leaves_a_consistent_session(tiny):
    session = ChatSession(tiny, DOC, max_new_tokens=20)
    reply = session.ask("Tell me everything.")
    for _ in range(3):
        next(reply)
    reply.close()  # what Ctrl-C does in the CLI
    assert session.last.new_tokens == 3
    follow = _answer(session, "Anything else?")

    fresh = ChatSession(tiny, DOC, max_new_tokens=20)
    fresh.history = list(session.history[:2])
    assert _answer(fresh, "Anything else?") == follow


def test_reset_keeps_the_document_cached(tiny):
    session = ChatSession(tiny, DOC, max_new_tokens=4)
    _answer(session, "Hi")
    session.reset()
    _answer(session, "Hi again")
    assert session.last.prefilled_tokens < 20 and session.turns == 1


def test_too_long_is_refused_with_lengths_and_truncation_fits(tiny):
    long_doc = DOC * 20  # > 512 tokens, the tiny model's context
    with pytest.raises(QspecError, match=r"document is \d+ tokens.*context is 512 tokens"):
        _answer(ChatSession(tiny, long_doc, max_new_tokens=8), "Summarize.")
    session = ChatSession(tiny, long_doc, max_new_tokens=8, truncate=True)
    assert session.truncated_tokens > 0
    _answer(session, "Summarize the document above.")
    assert session.last.prompt_tokens + 8 <= 512
