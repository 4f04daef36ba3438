"""Every model family against transformers' own implementation, on tiny random checkpoints
made here: logits within tolerance, and greedy tokens identical through qspec's generation
paths (`ar` on the full-precision cache; `target-ar` and `quantspec` on the hierarchical
cache, with a 4-bit RTN draft), on the runner `build_runner` gives (the C++ kernels where the
machine has them). Every family gets the CPU runner; those whose layer the one-call C++ stack
does not compute (`LayerSpec.native_ok()` false) must run the model's layer loop on its ops,
never the stack. Adding a family: its file in `qspec_core/families/` and a line in FAMILIES
below."""

from dataclasses import replace

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.config import SUPPORTED_MODEL_TYPES, ModelConfig
from qspec_core.engine.generate import decode, prefill, prefill_hierarchical
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats, speculative_decode
from qspec_core.errors import UnsupportedModelError
from qspec_core.families import FAMILIES
from qspec_core.model.transformer import attach_draft, linear_layers
from qspec_core.precision import TARGET
from qspec_core.quant.int4 import Int4Linear
from qspec_core.runner import CpuRunner, TorchRunner, build_runner

# Phi-3.5's RoPE on the tiny shape: 8 channel pairs, pretrained on 8 positions
LONGROPE = {
    "original_max_position_embeddings": 8,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.2, 1.5, 1.9, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.5, 3.0, 4.0, 6.0, 8.0, 9.0],
    },
}
# model_type -> the HF config overrides its tiny checkpoint takes (head_dim 16: 64 / 4 heads)
CASES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "qwen3+bias": {"head_dim": 16, "attention_bias": True},
    "olmo2": {},
    "olmo2+bias": {"attention_bias": True},
    "phi3": {"pad_token_id": 0},
    "phi3+window": {"pad_token_id": 0, "sliding_window": 48},  # (past the 36 tokens run)
    "phi3+longrope": {"pad_token_id": 0, **LONGROPE},  # (every forward here is long)
    "phi3+partial": {"pad_token_id": 0, "partial_rotary_factor": 0.5},
    "phi3+partial+longrope": {  # Phi-4-mini's kind: LongRoPE on the rotated channels only
        "pad_token_id": 0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 8,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    },
    "gemma3_text": {  # both layer kinds, each RoPE, a query scalar other than head_dim
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "sliding_window": 48,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    },
    "gemma2": {  # caps low enough to bend these scores and logits: a missing tanh shows
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 48,
        "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 2.0,
        "attn_implementation": "eager",  # (transformers' SDPA path has no soft cap)
    },
}
NATIVE = {  # whether the one-call C++ step computes the layer
    "llama": True,
    "mistral": True,
    "qwen2": True,
    "qwen3": True,
    "olmo2": True,
    "phi3": True,
    "gemma3_text": True,
    "gemma2": True,  # (its capped scores on the hierarchical cache)
}
N_NEW = 24


def _hf(case: str):
    return tiny_hf(case.split("+")[0], **CASES[case])


def _prompt(n=12):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _hf_greedy(hf, prompt, n_new) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n_new):
            token = hf(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, token.view(1, 1)], 1)
    return ids[0, len(prompt) :].tolist()


def test_every_family_file_has_a_case():
    assert set(SUPPORTED_MODEL_TYPES) == set(NATIVE) == {c.split("+")[0] for c in CASES}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case):
    hf = _hf(case)
    ours = ours_from_hf(hf)
    native = NATIVE[case.split("+")[0]]
    assert ours.config.native_ok() == native
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        cache = FullPrecisionCache(ours.config, 48, batch_size=2, dtype=torch.float32)
        got = ours(tokens, torch.arange(40), cache)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    # the CPU runner for every family (its kernels for the linears, norms and RoPE), and its
    # one-call stack where the layer allows it, else the model's loop on those ops
    runner = build_runner(ours)
    if cpu_ext.available():
        assert isinstance(runner, CpuRunner)
        assert (runner.stack("full") is not None) == native
    else:
        assert isinstance(runner, TorchRunner)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_transformers_in_every_mode(case):
    hf = _hf(case)
    model = ours_from_hf(hf)
    prompt = _prompt()
    expected = _hf_greedy(hf, prompt, N_NEW)
    params, gen = SamplingParams(), torch.Generator().manual_seed(0)

    size = len(prompt) + N_NEW + 8
    runner = build_runner(model)
    cache = FullPrecisionCache(model.config, size, dtype=torch.float32)
    logits = prefill(runner, cache, prompt, 0)
    assert list(decode(runner, cache, logits, len(prompt), N_NEW, params, gen)) == expected  # ar

    drafts = {n: Int4Linear.from_linear(m, 32) for n, m in linear_layers(model).items()}
    attach_draft(model, drafts)
    runner = build_runner(model)  # (built after the twins are attached, as the runtime does)
    runs = {}
    for mode in ("target-ar", "quantspec"):
        cache = HierarchicalKVCache(model.config, size, dtype=torch.float32)
        logits = prefill_hierarchical(runner, cache, prompt)
        if mode == "target-ar":
            out = decode(runner, cache, logits, len(prompt), N_NEW, params, gen, path=TARGET)
        else:
            stats = SpecStats()
            out = speculative_decode(
                runner, cache, logits, len(prompt), N_NEW, params, gen, gamma=4, stats=stats
            )
        runs[mode] = list(out)
    assert runs["quantspec"] == runs["target-ar"]
    assert stats.rounds > 0
    assert runs["target-ar"] == expected  # (the INT8 KV keeps these tiny models' argmax)


# Each way a family slides, with a window of 16 (the tiny shape's 2 layers; Gemma's layer_types
# default, Qwen's max_window_layers), run at several windows' length: every key a local layer
# hides shows in the logits
WINDOW = 16
WINDOWED = {
    "mistral": {"sliding_window": WINDOW},  # every layer
    "phi3": {"pad_token_id": 0, "sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma3_text": {**CASES["gemma3_text"], "sliding_window": WINDOW},  # local, global
    "gemma2": {**CASES["gemma2"], "sliding_window": WINDOW},  # transformers' alternation
}
LONG = 200  # tokens of the prompt: 12 windows


def _windowed_hf(model_type: str):
    return tiny_hf(model_type, max_position_embeddings=512, **WINDOWED[model_type])


@pytest.mark.parametrize("model_type", WINDOWED)
def test_sliding_windows_match_transformers_far_past_the_window(model_type):
    """Logits of a 200-token forward (one prefill on the full-precision cache, then the
    hierarchical cache's chunked prefill), and greedy tokens in ar, target-ar and quantspec,
    as transformers gives them with the same window: its local layers see their last 16
    positions, its global ones all. Before windows, qspec refused inputs past the window."""
    hf = _windowed_hf(model_type)
    model = ours_from_hf(hf)
    assert model.config.context_limit == 512 and WINDOW in model.config.windows
    prompt = _prompt(LONG)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits
        cache = FullPrecisionCache(model.config, LONG, dtype=torch.float32)
        got = model(torch.tensor([prompt]), torch.arange(LONG), cache)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    unwindowed = ours_from_hf(hf)
    unwindowed.config = replace(model.config, sliding_window=None)  # (the test has teeth)
    with torch.no_grad():
        cache = FullPrecisionCache(unwindowed.config, LONG, dtype=torch.float32)
        whole = unwindowed(torch.tensor([prompt]), torch.arange(LONG), cache)
    assert (whole - got).abs().max() > 1e-2

    n_new = 12
    tokens = _hf_greedy(hf, prompt, n_new)
    params, gen, size = SamplingParams(), torch.Generator().manual_seed(0), LONG + n_new + 8
    runner = build_runner(model)
    cache = FullPrecisionCache(model.config, size, dtype=torch.float32)
    logits = prefill(runner, cache, prompt, 0)
    assert list(decode(runner, cache, logits, LONG, n_new, params, gen)) == tokens  # ar
    drafts = {n: Int4Linear.from_linear(m, 32) for n, m in linear_layers(model).items()}
    attach_draft(model, drafts)
    runner, runs = build_runner(model), {}
    for mode in ("target-ar", "quantspec"):
        cache = HierarchicalKVCache(model.config, size, dtype=torch.float32)
        logits = prefill_hierarchical(runner, cache, prompt, chunk_size=64)  # (several chunks)
        if mode == "target-ar":
            out = decode(runner, cache, logits, LONG, n_new, params, gen, path=TARGET)
        else:
            out = speculative_decode(runner, cache, logits, LONG, n_new, params, gen, gamma=4)
        runs[mode] = list(out)
    assert runs["quantspec"] == runs["target-ar"] == tokens


def test_longrope_picks_its_factors_by_the_cache_capacity():
    """Short factors for a sequence whose cache fits the pretraining length (transformers'
    choice for a forward that ends within it), long ones for a bigger cache, whatever the
    forward's length (transformers would pick short for this 8-token forward: the documented
    difference that keeps a sequence's keys on one RoPE)."""
    hf = _hf("phi3+longrope")
    ours = ours_from_hf(hf)
    tokens = torch.randint(0, 101, (1, 8), generator=torch.Generator().manual_seed(2))
    F32 = torch.float32
    with torch.no_grad():
        expected = hf(tokens).logits
        logits = {
            capacity: ours(
                tokens, torch.arange(8), FullPrecisionCache(ours.config, capacity, dtype=F32)
            )
            for capacity in (8, 9)
        }
    torch.testing.assert_close(logits[8], expected)
    assert (logits[9] - expected).abs().max() > 0.1
    grown = FullPrecisionCache(ours.config, 8, dtype=F32)
    grown.grow(16)  # (an `ar` chat's cache grows: its sequence keeps its factors)
    assert grown.rope_capacity == 8 and grown.max_seq_len == 16


def test_unsupported_family_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf_config({"model_type": "gpt_neox"})
    message = str(info.value)
    assert "'gpt_neox' is not supported" in message and "\n" not in message
    for model_type, family in FAMILIES.items():
        assert model_type in message and family.label in message


def test_fused_checkpoint_tensors_are_split_or_refused():
    """Phi-3's qkv_proj / gate_up_proj load as q/k/v and gate/up; rows that do not add up to
    the parts the config implies are a user error naming the tensor."""
    from qspec_core.errors import QspecError
    from qspec_core.model.checkpoint import build_model

    hf = _hf("phi3")
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(config, state, dtype=torch.float32)
    qkv = state["layers.1.self_attn.qkv_proj.weight"]
    assert model.layers[1].self_attn.k_proj.weight.equal(qkv[64:96])  # q: 4 x 16, k: 2 x 16
    state["layers.1.self_attn.qkv_proj.weight"] = qkv[:-1]
    with pytest.raises(QspecError, match=r"qkv_proj.weight has 127 rows.*implies 128"):
        build_model(config, state, dtype=torch.float32)


@pytest.mark.parametrize("case", ["qwen3", "olmo2", "phi3", "gemma3_text", "gemma2"])
def test_converted_folder_loads_and_speculates(case, tmp_path):
    """`qspec convert`'s library call on a saved tiny checkpoint of the family: the loaded
    folder keeps the target's logits, and greedy QuantSpec on its 4-bit draft and INT8
    verifier weights gives target-ar's tokens."""
    from qspec_core.convert.convert import convert
    from qspec_core.convert.folder import load_converted
    from qspec_core.model.checkpoint import load_model

    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    convert(
        tmp_path / "hf", tmp_path / "conv", load_model(tmp_path / "hf", torch.float32), "rtn", 32
    )
    model = load_converted(tmp_path / "conv", dtype=torch.float32)
    assert all(m.draft is not None for m in linear_layers(model).values())
    tokens = torch.tensor([_prompt(20)])
    with torch.no_grad():
        cache = FullPrecisionCache(model.config, 20, dtype=torch.float32)
        torch.testing.assert_close(model(tokens, torch.arange(20), cache), hf(tokens).logits)
    prompt, params, runs = _prompt(), SamplingParams(), {}
    for mode in ("target-ar", "quantspec"):
        gen = torch.Generator().manual_seed(0)
        cache = HierarchicalKVCache(model.config, len(prompt) + N_NEW + 8, dtype=torch.float32)
        logits = prefill_hierarchical(model, cache, prompt)
        if mode == "target-ar":
            out = decode(model, cache, logits, len(prompt), N_NEW, params, gen, path=TARGET)
        else:
            out = speculative_decode(model, cache, logits, len(prompt), N_NEW, params, gen, gamma=4)
        runs[mode] = list(out)
    assert runs["quantspec"] == runs["target-ar"]


def test_gemma3_reads_transformers4_configs_and_refuses_softcapping():
    hf = {
        "model_type": "gemma3_text",
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 16,
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 2,
        "sliding_window": 512,
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    config = ModelConfig.from_hf_config(hf)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert (config.rope_theta, config.rope_type, config.rope_local_base_freq) == (
        1e6,
        "linear",
        1e4,
    )
    assert config.context_limit == 2048 and config.layer.native_ok()  # (the window: 512)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # (Gemma 2's)
        with pytest.raises(UnsupportedModelError, match=key):
            ModelConfig.from_hf_config({**hf, key: 30.0})


@pytest.mark.parametrize(
    "kind,hf_norm",
    [
        ("rms", "llama.modeling_llama.LlamaRMSNorm"),
        ("rms_fp32", "olmo2.modeling_olmo2.Olmo2RMSNorm"),
        ("rms_plus_one", "gemma3.modeling_gemma3.Gemma3RMSNorm"),
    ],
)
def test_each_norm_kind_gives_transformers_bits_in_bf16(kind, hf_norm):
    """The order of the scale and the cast differs by family, and shows in bf16."""
    import importlib

    from qspec_core.model.transformer import RMSNorm

    module, name = hf_norm.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    g = torch.Generator().manual_seed(0)
    weight = (1 + 0.3 * torch.randn(64, generator=g)).bfloat16()
    x = torch.randn(8, 64, generator=g).bfloat16()
    theirs, ours = cls(64, eps=1e-6).bfloat16(), RMSNorm(64, 1e-6, kind).bfloat16()
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
        assert ours(x).equal(theirs(x))
