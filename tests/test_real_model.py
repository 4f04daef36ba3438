"""End-to-end checks on the real default model (SmolLM2-135M-Instruct, converted once)."""

import dataclasses
import json

import pytest
import torch
from conftest import DATA, run_qspec

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.engine.generate import decode, prefill
from qspec_core.engine.planner import START_GAMMA
from qspec_core.engine.sampling import SamplingParams
from qspec_core.precision import DRAFT_W4, FP

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    ).eval()


def test_greedy_continuation_equals_transformers(real_runtime, hf_model):
    text = (DATA / "gpl-3.0.txt").read_text()[:1500]  # a real text, ~330 tokens
    ids = real_runtime.tokenizer.encode(text)
    n_new = 40
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new
        )[0, len(ids) :].tolist()
    model = real_runtime.runner  # (what qspec runs: the C++ kernels where built)
    cache = FullPrecisionCache(model.config, len(ids) + n_new, dtype=model.dtype)
    logits = prefill(model, cache, ids, 0, chunk_size=128)
    got = list(decode(model, cache, logits, len(ids), n_new, SamplingParams(), None))
    assert len(got) == n_new
    assert got == expected


def test_prefill_logits_match_transformers(real_runtime, hf_model):
    ids = real_runtime.tokenizer.encode((DATA / "apache-2.0.txt").read_text()[:3000])
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0, -1]
    model = real_runtime.runner
    cache = FullPrecisionCache(model.config, len(ids), dtype=model.dtype)
    got = prefill(model, cache, ids, 0, chunk_size=100)
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max()


def test_chat_template_and_tokens_match_transformers(real_runtime, default_model_dir):
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    for messages in (
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Doc:\n\nline one\nline two"},
            {"role": "user", "content": "What?"},
            {"role": "assistant", "content": "This."},
            {"role": "user", "content": "Why ünïcödé?"},
        ],
    ):
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert real_runtime.tokenizer.render_chat(messages, True) == expected
        assert (
            real_runtime.tokenizer.encode(expected)
            == hf_tok(expected, add_special_tokens=False)["input_ids"]
        )
    assert 2 in real_runtime.stop_ids  # <|im_end|>


def test_summarize_json_on_the_real_model(default_model_dir):
    """Default mode quantspec (the default model's GPTQ draft is made once per machine)."""
    apache = DATA / "apache-2.0.txt"
    args = ("summarize", apache, "--max-new-tokens", "24", "--json", "--dtype", "fp32")
    proc = run_qspec(*args, timeout=900)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in (
        "text",
        "mode",
        "model",
        "prompt_tokens",
        "new_tokens",
        "tokens_per_s",
        "timings_s",
        "stats",
        "peak_rss_bytes",
    ):
        assert key in result
    assert result["mode"] == "quantspec" and result["model"] == "SmolLM2-135M-Instruct"
    assert result["prompt_tokens"] > 2000 and 0 < result["new_tokens"] <= 24
    stages = {"tokenize", "prefill", "lookup", "draft", "verify", "accept"}
    assert set(result["timings_s"]) >= stages  # (auto starts with a 4-bit round)
    stats = result["stats"]
    for key in (
        "acceptance_rate",
        "tokens_per_target_step",
        "gamma",
        "rounds",
        "accepted",
        "recovered",
        "bonus",
        "draft_steps",
    ):
        assert key in stats
    assert stats["gamma"] == "auto" and stats["rounds"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    # the planner's choices follow this machine's timings: a tree round is listed when one ran
    always = {"draft", "lookup", "none"}
    assert always <= set(stats["sources"]) <= always | {"tree"}
    assert sum(s["rounds"] for s in stats["sources"].values()) == stats["rounds"]
    assert stats["draft_steps"] >= START_GAMMA  # (auto's first round times the 4-bit path)
    assert result["tokens_per_s"] > 0 and len(result["text"].split()) >= 5


@pytest.fixture(scope="module")
def draft_runtime(default_converted):
    from qspec_core.registry.runtime import load_runtime

    return load_runtime(None, dtype="fp32", log=lambda m: None, need_draft=True)


def _greedy_answers(runtime, text: str, question: str, new_tokens: int, gamma=4):
    from qspec_core.engine.session import ChatSession

    answers, stats = {}, None
    for mode in ("target-ar", "quantspec"):
        session = ChatSession(runtime, text, max_new_tokens=new_tokens, mode=mode, gamma=gamma)
        for _ in session.ask(question):
            pass
        answers[mode] = session._cached_ids[session.last.prompt_tokens :]
        stats = session.last.spec if mode == "quantspec" else stats
    return answers, stats


@pytest.mark.parametrize(
    ("weights", "gamma"), [("full", 4), ("int8", 4), ("w8a8", 4), ("w8a8", "auto")]
)
def test_greedy_quantspec_equals_target_ar_on_a_real_document(draft_runtime, weights, gamma):
    """128 new tokens after ~3,000 tokens of a real text: token for token identical, with the
    checkpoint's weights, the INT8 verifier weights and W8A8 (the CPU default), with drafts
    from the 4-bit path and from the document, at gamma 4 and `auto` (the default)."""
    runtime = dataclasses.replace(draft_runtime, target_weights=weights)
    tok = runtime.tokenizer
    text = tok.decode(tok.encode((DATA / "gpl-3.0.txt").read_text())[:3000])
    # a question whose answer runs long: greedy, no early stop token
    answers, stats = _greedy_answers(
        runtime,
        text,
        "Rewrite the first section of the document in your own words, at length.",
        128,
        gamma,
    )
    assert len(answers["target-ar"]) >= 64
    assert answers["quantspec"] == answers["target-ar"]
    assert stats.rounds > 10 and 0.2 < stats.acceptance_rate < 1.0
    if gamma == 4:  # (auto's choices depend on this machine's timings)
        sources = stats.sources()
        assert sources["draft"]["accepted"] > 0 and sources["lookup"]["accepted"] > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_real_verify_logits_equal_one_token_at_a_time(default_converted, dtype):
    """On the real model (and its INT8 twins): a verify's logits are bit for bit those of
    target-ar's one-token steps, so near ties break the same way in both modes. bf16 runs
    where the CPU has native bf16 (elsewhere a bf16 prefill takes minutes; the tiny-model
    test in test_batch_invariance.py covers bf16 everywhere)."""
    from qspec_core.cache.hierarchical import HierarchicalKVCache
    from qspec_core.engine.generate import prefill
    from qspec_core.precision import TARGET
    from qspec_core.registry.runtime import cpu_has_fast_bf16, load_runtime

    if dtype == "bf16" and not cpu_has_fast_bf16():
        pytest.skip("bf16 matmuls are emulated on this CPU (minutes per prefill)")
    rt = load_runtime(None, dtype=dtype, log=lambda m: None, need_draft=True)
    ids = rt.tokenizer.encode((DATA / "apache-2.0.txt").read_text())[:300]
    prompt, following = ids[:283], ids[283:300]  # 17 = gamma + 1 for gamma 16
    for weights in ("full", "int8", "w8a8"):
        path = TARGET.with_weights(weights)
        caches = []
        for _ in range(2):
            cache = HierarchicalKVCache(rt.model.config, 512, dtype=rt.model.dtype)
            with torch.no_grad():
                prefill(rt.runner, cache, prompt, 0, path, chunk_size=cache.group_size)
            cache.commit(len(prompt))
            caches.append(cache)
        n = len(prompt)
        with torch.no_grad():
            pos = torch.arange(n, n + 17)
            together = rt.runner(torch.tensor([following]), pos, caches[0], path)[0]
            alone = torch.cat(
                [
                    rt.runner(torch.tensor([[t]]), torch.tensor([n + i]), caches[1], path)[0]
                    for i, t in enumerate(following)
                ]
            )
        assert torch.equal(together, alone), weights


def test_our_kernels_package_is_not_taken_for_hf_kernels():
    # transformers probes for Hugging Face's `kernels` hub package; ours must not look like it,
    # or transformers would try to fetch kernels from the hub (offline failure).
    from transformers.utils.import_utils import is_kernels_available

    import kernels

    assert kernels.__file__.endswith("kernels/__init__.py")
    assert not is_kernels_available()


def test_kv_views_quality_on_the_real_model(real_runtime):
    """INT8 (target) KV stays within 1% perplexity of full precision; INT4 (draft) is worse."""
    from qspec_core.bench.quality import measure_kv_quality

    ids = real_runtime.tokenizer.encode((DATA / "gpl-3.0.txt").read_text())[:640]
    q = measure_kv_quality(real_runtime.model, ids, runner=real_runtime.runner)
    assert q.perplexity["target"] < 1.01 * q.perplexity["fp"]
    assert q.kl_vs_fp["target"] < q.kl_vs_fp["draft"] / 10
    assert q.top1_vs_fp["target"] > 0.97 and q.top1_draft_vs_target > 0.85
    assert q.bytes_per_token["draft"] < q.bytes_per_token["target"] < q.bytes_per_token["bf16"]


def test_convert_cli_on_the_default_model(default_model_dir, tmp_path):
    """`qspec convert` (RTN, group 64) on the real model: the draft differs from the target,
    and the converted folder loads with its draft."""
    out = tmp_path / "smol-rtn"
    proc = run_qspec("convert", "-o", out, "--method", "rtn", "--calib-tokens", "128", "--json")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout)
    assert meta["group_size"] == 64  # 128 does not divide hidden 576; never 32 (see facts)
    assert len(meta["modules"]) == 30 * 7 + 1
    report = meta["report"]
    assert 0.3 < report["top1_agreement"] < 0.99 and report["kl"] > 0.01  # differs, not noise
    from qspec_core.convert.folder import load_converted

    model = load_converted(out, dtype=torch.float32)
    assert model.lm_head.draft is not None and model.layers[5].mlp.down_proj.draft is not None
    # the draft runs: greedy decoding on the draft path (4-bit weights, fp KV) continues the
    # real text coherently (measured with RTN g64: "...ede or control is exercised; (ii) the
    # right to cede or" against the target's "...ede control of a particular entity to
    # another entity; (ii) the power"; since the prefill attention's fold changed its
    # rounding (2026-12-03), "...ede, (ii) the right to cede, (iii) the": 7 distinct tokens
    # shared; a draft that had lost the text would share a few common ones at most)
    from qspec_core.model.tokenizer import Tokenizer

    ids = Tokenizer(out).encode((DATA / "apache-2.0.txt").read_text()[:800])
    outs = {}
    for name, path in (("fp", FP), ("draft", DRAFT_W4)):
        cache = FullPrecisionCache(model.config, len(ids) + 16, dtype=model.dtype)
        logits = prefill(model, cache, ids, 0, path)
        outs[name] = list(
            decode(model, cache, logits, len(ids), 16, SamplingParams(), None, path=path)
        )
    assert len(outs["draft"]) == 16 and outs["draft"] != [outs["draft"][0]] * 16
    assert len(set(outs["draft"]) & set(outs["fp"])) >= 6
