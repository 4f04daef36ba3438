"""The full-precision cache (the `ar` baseline's) keeps a sliding-window layer's keys in a
stack of a window's worth of positions: the keys no query sees are dropped as new ones come,
nothing any query sees changes (bit for bit, on the C++ stack and on the layer loop), a
rollback past what is kept is refused, and a checkpoint brings the dropped keys back."""

import pytest
import torch
import transformers
from conftest import TINY_SHAPE, TINY_VOCAB, tiny_converted
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from qspec_core.cache import full as full_cache
from qspec_core.cache.full import REWIND, FullPrecisionCache
from qspec_core.engine.generate import prefill
from qspec_core.engine.session import ChatSession
from qspec_core.precision import FP
from qspec_core.registry.runtime import load_runtime
from qspec_core.runner import CpuRunner, build_runner

WINDOW, LONG = 16, 400  # (the local stack's room: WINDOW // LOCAL_ROOM_SHARE, 2)
# Qwen2 with its window from layer 1 on: layer 0 global, layer 1 local (one layer per stack)
QWEN = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


class LoopRunner(CpuRunner):
    """The CPU runner without its stack: every forward goes through the cache's `attend`."""

    def stack(self, weights):
        return None


def _model(positions=1024):
    return ours_from_hf(tiny_hf("qwen2", max_position_embeddings=positions, **QWEN))


def _runner(kind, model):
    if kind == "loop":
        if not cpu_ext.available():
            pytest.skip("no C++ compiler here")
        return LoopRunner(model, cpu_ext.load())
    return build_runner(model)


def _tokens(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(runner, cache, tokens, start):
    """Feeds tokens[start:] one at a time, every fourth step first drafting three positions
    ahead one by one and rolling them back (a speculative round's rejected drafts): each
    step's logits."""
    out = []
    for p in range(start, len(tokens)):
        if p % 4 == 0 and p + 3 < len(tokens):
            for d in range(p, p + 3):
                runner(torch.tensor([[tokens[d]]]), torch.tensor([d]), cache, FP)
            cache.truncate(p)
        out.append(runner(torch.tensor([[tokens[p]]]), torch.tensor([p]), cache, FP)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["stack", "loop"])
def test_dropping_what_no_query_sees_changes_no_logit(kind):
    """Prefill in chunks of 8, then decode with rollbacks: the logits of a cache whose local
    stack holds a window and a few positions are those of one that never drops, to the bit."""
    model = _model()
    runner = _runner(kind, model)
    assert model.config.windows == (None, WINDOW)
    tokens, half = _tokens(LONG), LONG // 2
    windowed = FullPrecisionCache(model.config, LONG, dtype=torch.float32)
    never = FullPrecisionCache(model.config, LONG, dtype=torch.float32)
    never.room = LONG  # (a stack of the whole context: it never drops)
    never._resize_local(LONG)
    logits = []
    with torch.no_grad():
        for cache in (windowed, never):
            prefill(runner, cache, tokens[:half], 0, FP, chunk_size=8)
            logits.append(_decode(runner, cache, tokens, half))
    assert torch.equal(logits[0], logits[1])
    held = WINDOW + REWIND + windowed.room
    assert windowed.room == WINDOW // full_cache.LOCAL_ROOM_SHARE
    assert windowed.local_k.shape[3] == held and windowed.k.shape == never.k.shape
    assert windowed.local_base > LONG - held and never.local_base == 0
    full = never.nbytes()["full_precision"]
    assert windowed.nbytes()["full_precision"] < 0.6 * full  # (the local layer's half: a window)


def test_a_rollback_past_the_kept_keys_is_refused_and_a_checkpoint_goes_back():
    model = _model()
    runner = build_runner(model)
    tokens, more = _tokens(200), _tokens(100, seed=1)
    cache = FullPrecisionCache(model.config, 400, dtype=torch.float32)
    with torch.no_grad():
        prefill(runner, cache, tokens, 0, FP, chunk_size=8)
        point = cache.checkpoint()
        for i, t in enumerate(more):  # far past the window: the keys at the point drop
            runner(torch.tensor([[t]]), torch.tensor([200 + i]), cache, FP)
        assert cache.local_base > 200 - WINDOW
        floor = cache.rewind_floor
        assert floor == cache.local_base + WINDOW - 1 <= 300 - REWIND
        with pytest.raises(ValueError, match="local layers go back to"):
            cache.truncate(floor - 1)
        cache.truncate(floor)  # (a speculative round's rollback stays allowed)
        with pytest.raises(ValueError, match="dropped"):
            runner(torch.tensor([[3]]), torch.tensor([floor - 1]), cache, FP)
        cache.restore(point)
        got = runner(torch.tensor([[7]]), torch.tensor([200]), cache, FP)
        fresh = FullPrecisionCache(model.config, 400, dtype=torch.float32)
        prefill(runner, fresh, tokens, 0, FP, chunk_size=8)
        want = runner(torch.tensor([[7]]), torch.tensor([200]), fresh, FP)
    assert torch.equal(got, want)


def test_the_local_stack_stays_a_windows_size_at_any_context():
    """At 4x the context, the local layer's stack is the same size once decoding, the global
    layer's grows with it; a prefill chunk (512) grows the local stack for itself, and the
    next decode step shrinks it back; a whole prompt in one forward grows it for it."""
    model = _model(4096)
    runner = build_runner(model)
    held = {}
    with torch.no_grad():
        for n in (1024, 4096):
            cache = FullPrecisionCache(model.config, n + 1, dtype=torch.float32)
            tokens = _tokens(n + 1)
            prefill(runner, cache, tokens[:n], 0, FP)
            prefilled = cache.local_k.shape[3]
            runner(torch.tensor([tokens[n:]]), torch.tensor([n]), cache, FP)
            held[n] = (prefilled, cache.local_k.shape[3], cache.k.shape[3])
        one = FullPrecisionCache(model.config, 1024, dtype=torch.float32)
        runner(torch.tensor([_tokens(1024)]), torch.arange(1024), one, FP)
    size = WINDOW + REWIND + cache.room
    assert held[1024][0] >= 512 + WINDOW and held[4096][0] >= 512 + WINDOW
    assert held[1024][1] == held[4096][1] == size
    assert held[1024][2] == 1025 and held[4096][2] == 4097
    assert one.local_k.shape[3] >= 1024 - one.local_base


@pytest.fixture(scope="module")
def windowed_runtime(tmp_path_factory, default_model_dir):
    """A tiny random Mistral (every layer local, window 24) with the real tokenizer."""
    config = transformers.MistralConfig(
        **TINY_SHAPE | dict(intermediate_size=128),
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=24,
        **TINY_VOCAB,
    )
    converted = tiny_converted(tmp_path_factory, default_model_dir, config, "mistral")
    return load_runtime(str(converted), dtype="fp32", log=lambda m: None)


DOC = "The lighthouse keeper counted 41 ships in March and 17 in April. " * 3


def test_an_ar_chat_goes_back_to_the_document_after_its_local_layers_dropped_it(
    windowed_runtime,
):
    """Answers push the local layers' keys of the document's end out; the next question
    goes back to the document's checkpoint and answers as a fresh session does."""
    session = ChatSession(windowed_runtime, DOC, max_new_tokens=40, mode="ar")
    doc = len(session.document_prefix_ids())
    "".join(session.ask("How many ships?"))
    assert session._cache.local_base > doc - 24  # (the document's last keys dropped)
    follow = "".join(session.ask("And in April?"))
    assert session.last.prefilled_tokens < session.last.prompt_tokens  # (the document kept)

    fresh = ChatSession(windowed_runtime, DOC, max_new_tokens=40, mode="ar")
    fresh.history = list(session.history[:2])
    assert "".join(fresh.ask("And in April?")) == follow
