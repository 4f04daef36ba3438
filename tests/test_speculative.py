"""The speculative engine and its verifier: exactness, transactions, sampling law."""

import itertools

import pytest
import torch
from hf_tiny import tiny_hf

from kernels import MAX_DRAFTS
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.config import ModelConfig
from qspec_core.engine.generate import decode, prefill_hierarchical
from qspec_core.engine.sampling import SamplingParams, probabilities
from qspec_core.engine.speculative import SpecStats, speculative_decode
from qspec_core.engine.verify import residual_distribution, verify_greedy, verify_sampling
from qspec_core.errors import QspecError
from qspec_core.model.checkpoint import build_model
from qspec_core.model.transformer import attach_draft, linear_layers
from qspec_core.precision import FP, TARGET
from qspec_core.quant.int4 import Int4Linear
from qspec_core.runner import build_runner


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _model(vocab=101, seed=0, **kw):
    hf = tiny_hf("llama", vocab_size=vocab, seed=seed, **kw)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(
        config,
        {k.removeprefix("model."): v for k, v in hf.state_dict().items()},
        dtype=torch.float32,
    )
    attach_draft(model, {n: Int4Linear.from_linear(m, 32) for n, m in linear_layers(model).items()})
    return model


def _run(
    model, prompt, n_new, mode, gamma=4, params=SamplingParams(), seed=0, verifier=None, stats=None
):
    runner = build_runner(model)  # (the C++ kernels where built: what `qspec` runs)
    cache = HierarchicalKVCache(model.config, len(prompt) + n_new + 8, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    gen = _g(seed)
    if mode == "target-ar":
        out = decode(runner, cache, logits, len(prompt), n_new, params, gen, path=TARGET)
    else:
        out = speculative_decode(
            runner,
            cache,
            logits,
            len(prompt),
            n_new,
            params,
            gen,
            gamma=gamma,
            verifier=verifier,
            stats=stats,
        )
    return list(out), cache


def _echo_prompt(model) -> tuple[list[int], list[int]]:
    """(prompt, target-ar's 70 tokens after it) for a prompt that holds the model's own
    continuation of its end once already: ten random tokens, target-ar's 30 after them, the
    ten again. What lookup drafts from: greedy runs over it must give target-ar's tokens."""
    seed = torch.randint(0, 101, (10,), generator=_g(8)).tolist()
    said, _ = _run(model, seed, 30, "target-ar")
    prompt = seed + said + seed
    expected, _ = _run(model, prompt, 70, "target-ar")
    return prompt, expected


@pytest.mark.parametrize("gamma", [1, 3, 6, "auto"])
@pytest.mark.parametrize("prompt_len", [5, 37])
def test_greedy_quantspec_equals_target_ar(gamma, prompt_len):
    """Across rotations (G = 16, 70 new tokens cross several) and gamma values."""
    model = _model()
    prompt = torch.randint(0, 101, (prompt_len,), generator=_g(1)).tolist()
    expected, _ = _run(model, prompt, 70, "target-ar")
    stats = SpecStats()
    got, cache = _run(model, prompt, 70, "quantspec", gamma, stats=stats)
    assert got == expected
    assert stats.rounds > 0 and stats.drafted > 0
    if gamma != "auto":  # (auto drafts only while drafting pays: on this model, its timing rounds)
        assert 0 < stats.accepted < stats.drafted  # real rejections happened
    assert cache.quantized_len >= 48 and cache.seq_len == cache.committed  # 3+ rotations


def test_verify_greedy_cases():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):
        logits[i, t] = 1.0
    assert verify_greedy(torch.tensor([1, 5, 7]), logits) == (0, 3)  # reject the first
    assert verify_greedy(torch.tensor([3, 5, 1]), logits) == (2, 7)  # reject in the middle
    assert verify_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)  # all + bonus


def test_rejection_sampling_law_by_enumeration():
    """P(emit x) = q(x) min(1, p/q)(x) + P(reject) residual(x) must equal p(x), exactly."""
    g = _g(2)
    for _ in range(20):
        p = torch.rand(6, generator=g) ** 3
        p /= p.sum()
        q = torch.rand(6, generator=g) ** 3
        q /= q.sum()
        accept = torch.minimum(torch.ones(6), p / q)
        emitted = q * accept + (1 - (q * accept).sum()) * residual_distribution(p, q)
        torch.testing.assert_close(emitted, p, atol=1e-6, rtol=1e-5)


def test_verify_sampling_frequencies_follow_the_target():
    """gamma = 2, V = 5; n = 40000 rounds. First emitted token ~ p_1 exactly; each frequency
    has std <= 0.0025, bound 0.012 (~5 sigma)."""
    p = torch.tensor(
        [[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1, 0.6]]
    )
    q = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
    g = _g(3)
    counts = torch.zeros(5)
    for _ in range(40000):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        n, nxt = verify_sampling(drafts, q, p, g)
        counts[int(drafts[0]) if n >= 1 else nxt] += 1
    assert (counts / 40000 - p[0]).abs().max() < 0.012


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.8),
    ],
)
def test_sampled_quantspec_follows_the_target_path_distribution(params):
    """Second emitted token (the first that speculation decides) vs its exact law on the
    target path, V = 8, n = 1500 seeded runs; TV distance bound 0.08 (expected ~0.03)."""
    model = _model(vocab=8)
    prompt = [1, 2, 3, 4, 5]
    cache = HierarchicalKVCache(model.config, 16, dtype=torch.float32)
    first = probabilities(prefill_hierarchical(model, cache, prompt), params)
    exact = torch.zeros(8)
    for x in range(8):
        c = HierarchicalKVCache(model.config, 16, dtype=torch.float32)
        prefill_hierarchical(model, c, prompt)
        with torch.no_grad():
            logits = model(torch.tensor([[x]]), torch.tensor([5]), c, TARGET)[0, -1]
        exact += first[x] * probabilities(logits, params)
    counts = torch.zeros(8)
    for seed in range(1500):
        out, _ = _run(model, prompt, 2, "quantspec", 3, params, seed=seed)
        counts[out[1]] += 1
    assert 0.5 * float((counts / 1500 - exact).abs().sum()) < 0.08


def _forced(pattern):
    """A verifier that accepts pattern[k] drafts in round k and emits target argmax next."""
    rounds = itertools.cycle(pattern)

    def verifier(drafts, target_logits):
        n = min(next(rounds), len(drafts))
        return n, int(target_logits[n].argmax())

    return verifier


def assert_replays(model, prompt, out, cache) -> HierarchicalKVCache:
    """After a run that emitted `out` from `prompt`, the cache holds exactly the committed
    tokens (all but the last emitted one, which is pending, not fed), and its next logits equal
    those of a target-path replay of them (1e-5). Returns the replay's cache."""
    committed = prompt + out[:-1]
    assert cache.seq_len == cache.committed == len(committed)
    replay = HierarchicalKVCache(model.config, len(committed) + 8, dtype=torch.float32)
    prefill_hierarchical(model, replay, prompt)
    with torch.no_grad():
        for i, t in enumerate(committed[len(prompt) :]):
            model(torch.tensor([[t]]), torch.tensor([len(prompt) + i]), replay, TARGET)
            replay.commit(len(prompt) + i + 1)
        probe = torch.tensor([[out[-1]]]), torch.tensor([len(committed)])
        a = model(*probe, cache, TARGET)[0, -1]
        b = model(*probe, replay, TARGET)[0, -1]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return replay


@pytest.mark.parametrize("pattern", [[0] * 12, [2] * 12, [4] * 12, [0, 4, 1, 4, 3, 0, 4, 2] * 2])
def test_transactions_leave_exactly_the_committed_kv(pattern):
    """Rejection first / middle / all + bonus, rounds crossing F2's capacity: after the run
    the cache's next logits equal a target-path replay of the committed tokens (1e-5)."""
    model = _model()
    G = model.config.head_dim
    prompt = torch.randint(0, 101, (2 * G - 3,), generator=_g(4)).tolist()  # F2 near full
    out, cache = _run(model, prompt, 40, "quantspec", 4, verifier=_forced(pattern))
    replay = assert_replays(model, prompt, out, cache)
    assert replay.n_quant == cache.n_quant


@pytest.mark.parametrize(
    "gamma, match", [(16, "--gamma 16 needs a KV group size above it"), (MAX_DRAFTS + 1, "1..")]
)
def test_the_engine_refuses_a_gamma_no_round_can_verify(gamma, match):
    """The CLI's check (`config.check_gamma`), made again for library callers: G = 16 here."""
    with pytest.raises(QspecError, match=match):
        _run(_model(), [1, 2, 3], 5, "quantspec", gamma)


def test_cancel_between_draft_and_verify_restores_the_committed_cache():
    model = _model()
    prompt = torch.randint(0, 101, (30,), generator=_g(5)).tolist()
    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, 80, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)

    class Interrupting:
        """The runner, until the third verify: drafts are written, the verify not yet."""

        config, device, dtype = model.config, model.device, model.dtype
        verifies = 0

        def __call__(self, tokens, input_pos, c, path=FP, last_only=False):
            if path == TARGET and tokens.shape[1] > 1:
                self.verifies += 1
                if self.verifies == 3:
                    raise KeyboardInterrupt
            return runner(tokens, input_pos, c, path, last_only)

    interrupting = Interrupting()
    gen = speculative_decode(interrupting, cache, logits, 30, 50, SamplingParams(), None, gamma=4)
    emitted = []
    with pytest.raises(KeyboardInterrupt):
        for t in gen:
            emitted.append(t)
    assert cache.seq_len == cache.committed and cache.fp_len == [cache.fp_len[0]] * 2
    # continuing from the committed state gives exactly the uninterrupted output
    full, _ = _run(model, prompt, 50, "target-ar")
    assert emitted == full[: len(emitted)]
    n_cached = cache.seq_len
    assert n_cached == 30 + len(emitted) - 1  # the last emitted token is pending
    with torch.no_grad():
        logits = runner(torch.tensor([[emitted[-1]]]), torch.tensor([n_cached]), cache, TARGET)[
            0, -1
        ]
    cache.commit(n_cached + 1)
    resumed = list(
        decode(runner, cache, logits, n_cached + 1, 5, SamplingParams(), None, path=TARGET)
    )
    assert resumed == full[len(emitted) : len(emitted) + 5]
