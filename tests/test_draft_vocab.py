"""The draft's vocabulary slice (`engine/draft_vocab.py`): the sliced head computes exactly the
full head's logits of its rows, and speculation through it stays exact, greedy (even when the
target's tokens are all outside the slice) and sampled (q is zero outside the slice)."""

import pytest
import torch
from hf_tiny import tiny_hf

from qspec_core.bench.bandwidth import path_weight_bytes
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.config import ModelConfig
from qspec_core.engine.draft_vocab import DraftVocab, draft_ids, head_rows, vocab_head
from qspec_core.engine.generate import decode, prefill_hierarchical
from qspec_core.engine.plan import DecodePlan
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats, speculative_decode
from qspec_core.model.checkpoint import build_model
from qspec_core.model.transformer import attach_draft, attach_int8, linear_layers
from qspec_core.precision import DRAFT, DRAFT_KV4, TARGET
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.runner import TorchRunner, build_runner

VOCAB = 301


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _model(head4: bool = False):
    """A tiny Llama as `qspec convert` leaves the default model: 4-bit twins on every linear
    but the head, which drafts on its INT8 twin (W8A8: in_features a multiple of 64); with
    `head4` the head has its 4-bit twin too (the `all` recipe's, a Llama 3 1B's)."""
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    hf = tiny_hf("llama", vocab_size=VOCAB, max_position_embeddings=512, **shape)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    model = build_model(config, state, dtype=torch.float32)
    layers = linear_layers(model)
    attach_int8(model, {n: Int8Linear.from_linear(m) for n, m in layers.items()})
    drafts = {
        n: Int4Linear.from_linear(m, 64 if n == "lm_head" else 32)  # (W4A8 takes 64-groups)
        for n, m in layers.items()
        if head4 or n != "lm_head"
    }
    attach_draft(model, drafts)
    return model


def test_draft_ids_are_the_common_ids_and_the_prompts_sorted_once():
    ids = draft_ids([250, 7, 250, 120, 400, -1, 121], VOCAB, common=100)
    assert ids.tolist() == list(range(100)) + [120, 121, 250]
    assert draft_ids([5], VOCAB, common=10_000).tolist() == list(range(VOCAB))


@pytest.mark.parametrize("runner_kind", ["native", "torch"])
@pytest.mark.parametrize(
    "path, head4",
    [(DRAFT, False), (DRAFT, True), (DRAFT_KV4, False)],
    ids=["int8-head", "int4-head", "full-head"],
)
def test_the_sliced_head_computes_the_full_heads_logits_of_its_rows(runner_kind, path, head4):
    """The same logits: bit for bit on the INT8 head (W8A8 rows: an exact integer dot per
    row), to fp32 rounding on a 4-bit head (its fp32 sum over groups) and with full weights
    (the fp32 kernel's blocks of output rows)."""
    model = _model(head4)
    runner = build_runner(model) if runner_kind == "native" else TorchRunner(model)
    ids = draft_ids(torch.randint(0, VOCAB, (40,), generator=_g(1)).tolist(), VOCAB, 64)
    head = vocab_head(model, ids, path)
    assert head is not None and head.out_features == len(ids)
    if path is DRAFT:
        assert head.weight.is_meta  # (the full-precision rows are never read: not copied)
    prompt = torch.randint(0, VOCAB, (30,), generator=_g(2)).tolist()
    tokens, pos = torch.tensor([[3]]), torch.tensor([len(prompt)])
    outs = []
    for sub in (None, head):
        cache = HierarchicalKVCache(model.config, 64, dtype=torch.float32)
        prefill_hierarchical(runner, cache, prompt)
        outs.append(runner(tokens, pos, cache, path, head=sub)[0, -1])
    torch.testing.assert_close(outs[1], outs[0][ids], rtol=1e-6, atol=1e-6)
    if path is DRAFT and not head4:  # (W8A8: an exact integer dot per row, then one scale)
        assert torch.equal(outs[1], outs[0][ids])


def test_a_biased_head_is_not_sliced_a_4bit_one_is():
    model = _model(head4=True)
    head = vocab_head(model, torch.arange(10), DRAFT)
    assert isinstance(head.twin("int4"), Int4Linear) and head.out_features == 10
    assert head_rows(model, [1, 2], DRAFT, common=10) == 10
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB), requires_grad=False)
    model.lm_head.draft.bias = torch.zeros(VOCAB)
    assert vocab_head(model, torch.arange(10), DRAFT) is None
    assert DraftVocab.build(model, [1, 2], DRAFT, common=10) is None
    assert head_rows(model, [1, 2], DRAFT, common=10) == VOCAB  # (it reads the whole head)


def test_a_draft_step_reads_its_slices_rows_of_the_head():
    """What bench and decode_steps.py count for a draft step: the slice's rows of the INT8 head
    (its bytes, scales included), not the whole head."""
    model = _model()
    prompt = [250, 7, 250, 120, 400]
    vocab = DraftVocab.build(model, prompt, DRAFT, common=100)
    rows = head_rows(model, prompt, DRAFT, common=100)
    assert rows == len(vocab.ids) == 102  # (0..99, 120, 250; 400 is past the vocabulary)
    assert head_rows(model, prompt, DRAFT, common=None) == VOCAB
    whole = path_weight_bytes(model, "int4")
    head = sum(b.nbytes for b in model.lm_head.int8.buffers())  # (the int8 rows, the scales)
    sliced = sum(b.nbytes for b in vocab.head.int8.buffers())
    assert path_weight_bytes(model, "int4", head_rows=rows) == whole - head + sliced


def _spec(model, prompt, n_new, params, vocab, gamma=4, seed=0):
    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, len(prompt) + n_new + 8, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    stats = SpecStats()
    out = speculative_decode(runner, cache, logits, len(prompt), n_new, params, _g(seed),
                             gamma=gamma, stats=stats, draft_vocab=vocab)  # fmt: skip
    return list(out), stats


@pytest.mark.parametrize("head4", [False, True], ids=["int8-head", "int4-head"])
@pytest.mark.parametrize("common", [0, 64, 200])
def test_greedy_through_a_slice_is_target_ar(common, head4):
    """Identical tokens whatever the slice: with common 0 the draft sees only the prompt's
    ids, so most of the target's tokens cannot be proposed and rounds reject."""
    model = _model(head4)
    prompt = torch.randint(0, VOCAB, (40,), generator=_g(3)).tolist()
    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, 40 + 60 + 8, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    expected = list(decode(runner, cache, logits, 40, 60, SamplingParams(), _g(0), path=TARGET))
    vocab = DraftVocab.build(model, prompt, DRAFT, common)
    assert vocab is not None and len(vocab.ids) < VOCAB
    got, stats = _spec(model, prompt, 60, SamplingParams(), vocab)
    assert got == expected
    assert stats.draft_steps > 0


def test_sampled_drafts_come_from_the_slice_with_q_zero_outside():
    model = _model()
    prompt = torch.randint(0, VOCAB, (40,), generator=_g(4)).tolist()
    vocab = DraftVocab.build(model, prompt, DRAFT, common=32)
    seen = []

    def verifier(drafts, target_logits):  # (records the proposals, accepts none)
        seen.extend(drafts.tolist())
        return 0, int(target_logits[0].argmax())

    runner = build_runner(model)
    cache = HierarchicalKVCache(model.config, 40 + 30 + 8, dtype=torch.float32)
    logits = prefill_hierarchical(runner, cache, prompt)
    params = SamplingParams(temperature=1.0)
    list(speculative_decode(runner, cache, logits, 40, 30, params, _g(0), gamma=3,
                            verifier=verifier, draft_vocab=vocab))  # fmt: skip
    assert seen and set(seen) <= set(vocab.ids.tolist())
    q = torch.softmax(vocab.full(torch.randn(len(vocab.ids), generator=_g(5))), -1)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab.ids] = False
    assert torch.all(q[outside] == 0) and torch.isclose(q.sum(), torch.tensor(1.0))


def test_the_decode_plan_slices_the_draft_head_by_default():
    model = _model()
    prompt = torch.randint(0, VOCAB, (40,), generator=_g(6)).tolist()
    runner = build_runner(model)
    full = DecodePlan(TARGET, DRAFT, gamma=4, lookup=False, draft_common=None)
    sliced = DecodePlan(TARGET, DRAFT, gamma=4, lookup=False, draft_common=16)
    outs = []
    for plan in (full, sliced):
        cache = plan.new_cache(runner, 40 + 40 + 8)
        logits = prefill_hierarchical(runner, cache, prompt)
        tokens, stats = plan.start(runner, cache, logits, prompt, 40, SamplingParams(), _g(0))
        outs.append((list(tokens), stats))
    assert outs[0][0] == outs[1][0]  # (the same text)
    assert DecodePlan(TARGET, DRAFT).draft_common is not None
