"""The whole-stack C++ decode step (`kernels/cpu/step.cpp`, `qspec_core/runner/cpu_stack.py`)
against the model's own layer loop run with the CPU runner's ops, which it replaces: the same
bits on every path and cache, through rotations and late queries; and the runner's explicit
lifecycle: changes in place show at once, replaced tensors after `rebuild` (the runtime's `to`
builds a new runner)."""

import copy
from pathlib import Path

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.model.checkpoint import build_model
from qspec_core.model.transformer import attach_draft, attach_int8, linear_layers
from qspec_core.precision import DRAFT, DRAFT_KV4, DRAFT_W4, FP, TARGET, W8, W8_TARGET
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.registry.runtime import Runtime
from qspec_core.runner import CpuRunner, build_runner

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")


def _model(seed=0, **overrides):
    # head_dim 64 (the AVX2 attention), in_features multiples of 64 (the W4A8 draft)
    kw = dict(hidden_size=128, intermediate_size=192, num_attention_heads=2)
    kw.update(overrides)
    model = ours_from_hf(tiny_hf("llama", seed=seed, num_key_value_heads=1, **kw))
    drafts = {n: Int4Linear.from_linear(m, 64) for n, m in linear_layers(model).items()}
    attach_draft(model, drafts)
    return model


class LoopRunner(CpuRunner):
    """The CPU runner without its stack: every forward takes the model's layer loop with the
    runner's ops (what the stack must equal, bit for bit)."""

    def stack(self, weights):
        return None


def _runners(model):
    """(the CPU runner, its loop-only twin) of `model`."""
    ext = cpu_ext.load()
    return CpuRunner(model, ext), LoopRunner(model, ext)


def _used(runner, path) -> bool:
    return runner.stack(path.weights) is not None


def _rounds(runner, cache, path, ids, steps, commit=True):
    """Feeds ids in the given [start, stop) steps; returns the logits of all of them."""
    out = []
    with torch.no_grad():
        for start, stop in steps:
            out.append(runner(ids[:, start:stop], torch.arange(start, stop), cache, path))
            if commit:
                cache.commit(stop)
    return torch.cat(out, 1)


def _hier(model):
    return HierarchicalKVCache(model.config, 300, dtype=torch.float32)


def _full(model):
    return FullPrecisionCache(model.config, 200, dtype=torch.float32)


# a short prompt (plain causal), a prefill, then one-token and verify-sized steps, crossing
# several 64-token groups
STEPS = [(0, 5), (5, 64), (64, 120)] + [(p, p + 1) for p in range(120, 130)]
STEPS += [(130, 135), (135, 136), (136, 141), (141, 149), (149, 150)]


def _assert_stack_equals_loop(model, cache_kind, path):
    """The runner with its stack and its loop-only twin through STEPS on a fresh cache each:
    the same logits, bit for bit. Returns (those logits, the ids, the cache maker)."""
    runner, loop = _runners(model)
    ids = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(1))
    make = _full if cache_kind == "full" else _hier
    want = _rounds(loop, make(model), path, ids, STEPS)
    assert _used(runner, path)
    got = _rounds(runner, make(model), path, ids, STEPS)
    assert torch.equal(got, want)
    return want, ids, make


@pytest.mark.parametrize(
    "cache_kind, path",
    [
        ("full", FP),
        ("full", DRAFT_W4),
        ("hier", TARGET),
        ("hier", DRAFT),
        ("hier", DRAFT_KV4),
        ("full", W8),
        ("hier", W8_TARGET),
        ("hier", W8_TARGET.with_weights("w8a8")),
        ("full", W8.with_weights("w8a8")),
    ],
)
def test_stack_gives_the_layer_loops_bits(cache_kind, path):
    model = _model()
    if path.weights in ("int8", "w8a8"):
        layers = linear_layers(model)
        attach_int8(model, {n: Int8Linear.from_linear(m) for n, m in layers.items()})
    _assert_stack_equals_loop(model, cache_kind, path)


# Each family's layer at the C++ attention's head_dim 64 (tiny_hf's other shapes): every
# LayerSpec field the stack computes (q/k norms per head and over the projection, post and
# sandwich norms, 1 + w, GeGLU, a query scalar, Gemma 3's local RoPE and window, a partial
# rotary)
FAMILY_CASES = {
    "qwen3": {"head_dim": 64},
    "olmo2": {},
    "gemma3_text": {
        "head_dim": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 48,
        "sliding_window": 40,  # (the steps below run past it)
        "max_position_embeddings": 512,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    },
    "phi3": {"pad_token_id": 0, "partial_rotary_factor": 0.5, "max_position_embeddings": 512},
    # soft caps low enough to bend the scores (the hierarchical cache's C++ step caps them)
    "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 48, "attn_logit_softcapping": 1.5},
}


@pytest.mark.parametrize("cache_kind, path", [("hier", TARGET), ("hier", DRAFT), ("full", FP)])
@pytest.mark.parametrize("model_type", FAMILY_CASES)
def test_every_familys_stack_gives_the_layer_loops_bits(model_type, cache_kind, path):
    """The stack runs every supported family's layer (issue 54), bit for bit as the layer
    loop on the runner's ops does: Gemma 2's capped scores and Gemma 3's local layer past its
    window on both caches."""
    kw = dict(hidden_size=128, intermediate_size=192, num_attention_heads=2)
    hf = tiny_hf(model_type, num_key_value_heads=1, **kw, **FAMILY_CASES[model_type])
    model = ours_from_hf(hf)
    drafts = {n: Int4Linear.from_linear(m, 64) for n, m in linear_layers(model).items()}
    attach_draft(model, drafts)
    assert model.config.native_ok()
    want, ids, make = _assert_stack_equals_loop(model, cache_kind, path)
    if path.weights == "full":  # and the plain model's, to rounding (the draft's W4A8 rounds x)
        plain = _rounds(model, make(model), path, ids, STEPS[:3])
        assert (want[:, :120] - plain).abs().max() <= 1e-3 * plain.abs().max()


def test_soft_capped_and_windowed_steps_on_the_full_cache_run_the_stack():
    """The full-precision cache's C++ step caps Gemma 2's scores and gives a local layer past
    its window its own keys and mask (`FullStep.local_start`, `local_mask`): those steps run
    the stack (`test_every_familys_stack_gives_the_layer_loops_bits` holds them to the loop's
    bits), not the layer loop."""
    hf = tiny_hf("gemma2", head_dim=64, attn_logit_softcapping=1.5, num_key_value_heads=1)
    model = ours_from_hf(hf)
    assert CpuRunner(model, cpu_ext.load()).stack("full") is not None
    assert _full(model).native_step(torch.arange(1), FP, 1) is not None
    assert _hier(model).native_step(torch.arange(1), TARGET, 1) is not None
    case = {**FAMILY_CASES["gemma3_text"], "num_key_value_heads": 1}
    model = ours_from_hf(tiny_hf("gemma3_text", **case))
    cache = _full(model)
    step = cache.native_step(torch.arange(30), FP, 30)  # (within the window: one mask)
    assert step.local_start == -1 and step.is_causal
    cache.native_step(torch.arange(30, 100), FP, 70)
    step = cache.native_step(torch.arange(100, 101), FP, 1)  # (window 40: keys 61..100)
    assert step.local_start == 61 and step.local_mask is None and step.mask is None
    step = cache.native_step(torch.arange(101, 106), FP, 5)
    assert step.local_start == 62 and step.local_mask.shape == (5, 44)


def test_a_draft_without_some_4bit_twins_runs_their_int8_twins():
    """A recipe that keeps attention and lm_head out of the 4-bit draft (`gptq-mlp`): those
    layers draft on their INT8 twins (W8A8), in the stack exactly as in the layer loop; a
    twin replaced afterwards is seen once the runner rebuilds."""
    model = _model(seed=8)
    layers = linear_layers(model)
    attach_int8(model, {n: Int8Linear.from_linear(m) for n, m in layers.items()})
    for name, layer in layers.items():
        if ".mlp." not in name:
            layer.draft = None
    runner, loop = _runners(model)
    ids = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(9))
    want = _rounds(loop, _hier(model), DRAFT, ids, STEPS)
    assert _used(runner, DRAFT)
    got = _rounds(runner, _hier(model), DRAFT, ids, STEPS)
    assert torch.equal(got, want)
    q = model.layers[0].self_attn.q_proj
    q.int8 = Int8Linear.from_linear(torch.nn.Linear(128, q.out_features, bias=False))
    runner.rebuild()
    want2 = _rounds(loop, _hier(model), DRAFT, ids, STEPS[:4])
    got2 = _rounds(runner, _hier(model), DRAFT, ids, STEPS[:4])
    assert torch.equal(got2, want2) and not torch.equal(got2, got[:, : got2.shape[1]])


def test_speculative_rounds_with_rollbacks_and_late_queries():
    """Draft steps run past the committed length (late queries see F1 quantized on the fly),
    the verify rewrites them, the cache rolls back: the same logits and the same cache."""
    model = _model(seed=2)
    ids = torch.randint(0, 101, (1, 300), generator=torch.Generator().manual_seed(3))

    def rounds(runner):
        cache = _hier(model)
        out = [_rounds(runner, cache, TARGET, ids, [(0, 64), (64, 126)])]
        with torch.no_grad():
            for n in range(126, 270, 3):  # 4 drafts, a verify of 5, keep 3 of them
                for p in range(n, n + 4):
                    out.append(runner(ids[:, p : p + 1], torch.tensor([p]), cache, DRAFT))
                pos = torch.arange(n, n + 5)
                out.append(runner(ids[:, n : n + 5], pos, cache, TARGET))
                cache.truncate(n + 3)
                cache.commit(n + 3)
        return torch.cat(out, 1), cache.state(), cache.meta()

    runner, loop = _runners(model)
    want, want_state, want_meta = rounds(loop)
    got, state, meta = rounds(runner)
    assert torch.equal(got, want)
    assert meta == want_meta and meta["n_quant"] >= 192  # rotated on the way
    for name, t in want_state.items():
        assert torch.equal(state[name], t), name


def test_changes_in_place_show_and_replaced_tensors_after_a_rebuild():
    """The stack holds the model's tensors themselves: an in-place change shows at the next
    step. A tensor or twin replaced (load_state_dict(assign=True), a new Parameter, a new
    twin) shows once the runner rebuilds, explicitly: nothing is checked behind the call."""
    model = _model(seed=4)
    runner, loop = _runners(model)
    ids = torch.randint(0, 101, (1, 70), generator=torch.Generator().manual_seed(5))
    steps = [(0, 64), (64, 65), (65, 70)]

    def both(path):
        want = _rounds(loop, _hier(model), path, ids, steps)
        got = _rounds(runner, _hier(model), path, ids, steps)
        assert _used(runner, path)
        return got, want

    got, want = both(TARGET)
    assert torch.equal(got, want)
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(1.5)
    got2, want2 = both(TARGET)  # (no rebuild)
    assert torch.equal(got2, want2) and not torch.equal(got2, got)
    state = {k: v * 0.9 if "q_proj.weight" in k else v for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    runner.rebuild()
    got3, want3 = both(TARGET)
    assert torch.equal(got3, want3) and not torch.equal(got3, got2)
    layer = model.layers[1].self_attn.o_proj
    layer.weight = torch.nn.Parameter(layer.weight * 0.5, requires_grad=False)
    runner.rebuild()
    got4, want4 = both(TARGET)
    assert torch.equal(got4, want4) and not torch.equal(got4, got3)
    d1, _ = both(DRAFT)
    up = model.layers[0].mlp.up_proj
    up.draft = Int4Linear.from_linear(torch.nn.Linear(128, 192, bias=False), 64)
    runner.rebuild()
    d2, want_d2 = both(DRAFT)
    assert torch.equal(d2, want_d2) and not torch.equal(d2, d1)


def test_paths_the_stack_does_not_run_take_the_layer_loop():
    """AWQ-scaled twins and INT8 twins the int8 kernel cannot take run the model's layer loop
    with the runner's ops (and still work); each weight set has its own stack."""
    model = _model(seed=6)
    attach_int8(model, {n: Int8Linear.from_linear(m) for n, m in linear_layers(model).items()})
    runner, loop = _runners(model)
    assert _used(runner, TARGET) and _used(runner, DRAFT)
    full = runner.stack("full")
    assert _used(runner, W8_TARGET) and runner.stack("int8") is not full
    twin = Int8Linear.from_linear(torch.nn.Linear(128, 128))
    twin.weight_int8 = twin.weight_int8.t().contiguous().t()  # a layout the kernel refuses
    model.layers[0].self_attn.q_proj.int8 = twin
    proj = model.layers[1].self_attn.k_proj
    proj.draft = proj.draft.with_scales(torch.rand(128) + 0.5)
    runner.rebuild()
    assert not _used(runner, W8_TARGET) and not _used(runner, DRAFT)
    assert _used(runner, TARGET) and runner.stack("full") is not full  # (rebuilt)
    ids = torch.randint(0, 101, (1, 70), generator=torch.Generator().manual_seed(7))
    steps = [(0, 64), (64, 65), (65, 70)]
    for path in (W8_TARGET, DRAFT):
        want = _rounds(loop, _hier(model), path, ids, steps)
        assert torch.equal(_rounds(runner, _hier(model), path, ids, steps), want)


def test_the_runtime_builds_a_new_runner_when_it_moves_the_model():
    """`Runtime.to` casts the model and builds its runner again (the model has no `_apply`
    hook of its own); the old runner's stacks are dropped, the new one runs the new tensors.
    The model deep-copies with no C++ object on it."""
    model = _model(seed=7)
    runtime = Runtime(model, build_runner(model), None, Path("."), "tiny")
    old = runtime.runner
    assert _used(old, FP)
    copy.deepcopy(model)  # (the C++ stack lives in the runner, not on the model)
    runtime.costs.keep(4096, [0.01, 0.01], {1: [0.02]})  # (another dtype's step timings)
    runtime.to(dtype=torch.bfloat16)
    assert runtime.costs.recall(4096) is None
    assert runtime.runner is not old and not old._stacks
    assert model.dtype == torch.bfloat16 and not _used(runtime.runner, FP)  # (fp32 only)
    runtime.to(dtype=torch.float32)
    ids = torch.randint(0, 101, (1, 4))
    with torch.no_grad():
        out = runtime.runner(ids, torch.arange(4), _full(model), FP)
        want = model(ids, torch.arange(4), _full(model), FP)
    assert out.dtype == torch.float32 and _used(runtime.runner, FP)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def _bf16_valued(model):
    """`model` with every fp32 weight rounded to a bf16 number (a bf16 checkpoint in fp32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def test_bf16_valued_weights_are_read_as_bf16_copies_with_the_same_bits():
    """A bf16 checkpoint loaded in fp32 (SmolLM2, Qwen2.5): the stack and the row kernels of
    the layer loop and the head read bf16 copies of the full-precision weights (half the
    bytes; `runner/layouts.py`) and give the fp32 weights' bits, on a full cache and over the
    hierarchical one; an in-place change to a weight shows at the next step, its copy no
    longer read."""
    ext = cpu_ext.load()
    model = _bf16_valued(_model(seed=11))
    runner, loop = _runners(model)
    plain = CpuRunner(model, ext)
    plain.ops.layouts.bf16_rows = False  # (the fp32 weights only)
    ids = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(12))
    n_proj = 7 * len(model.layers)
    copies = n_proj if ext.BF16_WEIGHT_ROWS else 0  # (vector builds only: layouts.py)
    for make, path in ((_full, FP), (_hier, TARGET), (_hier, DRAFT_KV4)):
        want = _rounds(plain, make(model), path, ids, STEPS)
        assert torch.equal(_rounds(runner, make(model), path, ids, STEPS), want)
        assert torch.equal(_rounds(loop, make(model), path, ids, STEPS), want)
    assert runner.stack("full").compact_count() == copies
    assert plain.stack("full").compact_count() == 0
    assert (runner.ops.layouts.bf16(model.lm_head) is not None) == bool(copies)
    with torch.no_grad():  # (no longer bf16 numbers)
        model.layers[0].mlp.down_proj.weight.add_(1e-3 * torch.rand(1).item() + 1e-4)
    assert runner.stack("full").compact_count() == max(copies - 1, 0)
    want = _rounds(plain, _hier(model), TARGET, ids, STEPS[:6])
    assert torch.equal(_rounds(runner, _hier(model), TARGET, ids, STEPS[:6]), want)
    assert torch.equal(_rounds(loop, _hier(model), TARGET, ids, STEPS[:6]), want)
    # still bf16 numbers after the change (x2), and new storage through `.data` (no version
    # bump): neither stale copy is read; the rebuild makes the copies again
    with torch.no_grad():
        model.layers[1].self_attn.q_proj.weight.mul_(2.0)
    up = model.layers[1].mlp.up_proj.weight
    up.data = up.data * 0.5
    assert runner.stack("full").compact_count() == max(copies - 3, 0)
    want = _rounds(plain, _hier(model), TARGET, ids, STEPS[:6])
    assert torch.equal(_rounds(runner, _hier(model), TARGET, ids, STEPS[:6]), want)
    assert torch.equal(_rounds(loop, _hier(model), TARGET, ids, STEPS[:6]), want)
    runner.rebuild()
    assert runner.stack("full").compact_count() == max(copies - 1, 0)  # (down_proj: not bf16)
    assert torch.equal(_rounds(runner, _hier(model), TARGET, ids, STEPS[:6]), want)


def test_bf16_held_weights_give_the_fp32_weights_bits():
    """`build_model(bf16_held=True)` keeps a bf16 checkpoint's linears (and embedding) bf16
    under fp32 activations where the step kernels read bf16 rows exactly: the stack, the
    layer loop (its prefill GEMM upcasting one weight at a time) and the model's own forward
    give the bits of the same numbers held in fp32, for half the weight bytes."""
    ext = cpu_ext.load()
    if not ext.BF16_WEIGHT_ROWS:
        pytest.skip("a portable build: bf16 rows are not fp32's bits, no weight is held bf16")
    kw = dict(hidden_size=128, intermediate_size=192, num_attention_heads=2)
    base = _bf16_valued(ours_from_hf(tiny_hf("llama", seed=21, num_key_value_heads=1, **kw)))
    state = {k: t.bfloat16() for k, t in base.state_dict().items()}
    held = build_model(base.config, state, torch.float32, bf16_held=True)
    for name, layer in linear_layers(held).items():
        assert layer.weight.dtype == torch.bfloat16, name
    assert held.norm.weight.dtype == torch.float32 and held.dtype == torch.float32
    fp32_bytes = sum(t.nbytes for t in base.state_dict().values())
    assert sum(t.nbytes for t in held.state_dict().values()) < 0.55 * fp32_bytes
    plain = CpuRunner(base, ext)
    plain.ops.layouts.bf16_rows = False  # (the fp32 weights only)
    runner, loop = _runners(held)
    assert runner.stack("full") is not None
    ids = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(22))
    for make, path in ((_full, FP), (_hier, TARGET), (_hier, DRAFT_KV4)):
        want = _rounds(plain, make(base), path, ids, STEPS)
        assert torch.equal(_rounds(runner, make(held), path, ids, STEPS), want)
        assert torch.equal(_rounds(loop, make(held), path, ids, STEPS), want)
    with torch.no_grad():  # the model's own forward (the torch runner's ops): F.linear's bits
        want = base(ids, torch.arange(150), _full(base), FP)
        assert torch.equal(held(ids, torch.arange(150), _full(held), FP), want)


def test_weights_made_in_inference_mode_get_no_bf16_copies():
    """Inference tensors have no version counter (a change in place could not be seen): a model
    made under `torch.inference_mode` runs on its fp32 weights, the same bits."""
    with torch.inference_mode():
        model = _bf16_valued(_model(seed=13))
        runner, loop = _runners(model)
        ids = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(14))
        want = _rounds(loop, _hier(model), TARGET, ids, STEPS)
        assert torch.equal(_rounds(runner, _hier(model), TARGET, ids, STEPS), want)
        assert runner.stack("full").compact_count() == 0
        assert runner.ops.layouts.bf16(model.lm_head) is None
