"""The caches' C++ side (`kernels/cpu/kv_cache.py`): one object per cache writes a forward's
K/V into its buffers, for the cache's per-layer `attend` and the C++ stack alike, and the two
leave the same bits; the object follows the buffers when they are replaced."""

import ast
import copy
import re
from pathlib import Path

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.precision import DRAFT_KV4, FP, TARGET
from qspec_core.runner import CpuRunner

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")

ROOT = Path(__file__).resolve().parents[1]


def _model():
    # head_dim 64 (the AVX2 attention); G = 64, so 130 tokens cross two groups
    model = ours_from_hf(
        tiny_hf(
            "llama",
            seed=3,
            hidden_size=128,
            intermediate_size=192,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    return model


class LoopRunner(CpuRunner):
    """The CPU runner without its stack: every forward goes through the cache's `attend`."""

    def stack(self, weights):
        return None


def _make(kind, model):
    if kind == "hier":
        return HierarchicalKVCache(model.config, 300, dtype=torch.float32)
    return FullPrecisionCache(model.config, 300, dtype=torch.float32)


def _feed(runner, cache, ids, steps, path):
    with torch.no_grad():
        for start, stop in steps:
            runner(ids[:, start:stop], torch.arange(start, stop), cache, path)
            cache.commit(stop)


STEPS = [(0, 64), (64, 120)] + [(p, p + 1) for p in range(120, 126)] + [(126, 131)]


def _stack_steps(runner, cache, path):
    """Counts the forwards the stack ran (the cache's `native_step` gave a step)."""
    calls = []
    real = cache.native_step

    def counted(*args):
        step = real(*args)
        calls.append(step is not None)
        return step

    cache.native_step = counted
    return calls


@pytest.mark.parametrize("kind, path", [("hier", TARGET), ("hier", DRAFT_KV4), ("full", FP)])
def test_the_stack_and_the_layer_loop_leave_the_same_bits(kind, path):
    """The same tokens through the C++ stack (decode-sized steps) and through the cache's
    per-layer `attend`: every buffer the same, to the bit, the full-precision region included."""
    model = _model()
    ext = cpu_ext.load()
    ids = torch.randint(0, 101, (1, 131), generator=torch.Generator().manual_seed(1))
    stacked, looped = _make(kind, model), _make(kind, model)
    ran = _stack_steps(CpuRunner(model, ext), stacked, path)
    _feed(CpuRunner(model, ext), stacked, ids, STEPS, path)
    _feed(LoopRunner(model, ext), looped, ids, STEPS, path)
    assert sum(ran) == 7  # the one-token steps and the verify-sized one took the stack
    for name, buffer in looped.named_buffers():
        assert torch.equal(stacked.get_buffer(name), buffer), name


@pytest.mark.parametrize("kind, path", [("hier", TARGET), ("full", FP)])
def test_every_write_goes_through_the_object_the_cache_hands_out(monkeypatch, kind, path):
    """Both loops write only through `cache.native`: swapped for an object over copies of
    the buffers, the copies get the new K/V and the cache's own buffers none of it."""
    model = _model()
    ext = cpu_ext.load()
    ids = torch.randint(0, 101, (1, 70), generator=torch.Generator().manual_seed(2))
    for runner, steps in (
        (LoopRunner(model, ext), [(64, 66)]),
        (CpuRunner(model, ext), [(64, 65)]),
    ):
        cache = _make(kind, model)
        _feed(runner, cache, ids, [(0, 64)], path)
        before = {n: b.clone() for n, b in cache.named_buffers()}
        copies = {n: b.clone() for n, b in cache.named_buffers()}
        if kind == "hier":
            other = ext.HierKV(**copies, group_size=cache.group_size, chunk=cache.chunk_size)
        else:
            other = ext.FullKV(**copies)
        monkeypatch.setattr(type(cache), "native", property(lambda self, o=other: o))
        _feed(runner, cache, ids, steps, path)
        monkeypatch.undo()
        for name, buffer in cache.named_buffers():
            assert torch.equal(buffer, before[name]), name  # (not one bit written here)
        fp = "fp_k" if kind == "hier" else "k"
        assert not torch.equal(copies[fp], before[fp])  # (written there instead)


def test_the_object_follows_the_buffers():
    """Made over the cache's own tensors (in-place writes show), made again when a buffer is
    replaced, and absent for a region not fp32; a copy of the cache makes its own."""
    model = _model()
    cache = _make("hier", model)
    native = cache.native
    assert native is not None and cache.native is native
    cache.fp_k = cache.fp_k.clone()  # (a replaced buffer: `.to()`, a cast)
    assert cache.native is not native
    assert HierarchicalKVCache(model.config, 64, dtype=torch.bfloat16).native is None
    full = _make("full", model)
    made = full.native
    full.grow(400)
    assert full.native is not made and full.native is not None
    twin = copy.deepcopy(cache)
    assert twin.native is not None and twin.native is not cache.native


def test_no_other_code_writes_the_buffers():
    """A complement to the tests above, on the sources: in the C++, only `kv_cache.cpp`
    copies into a cache's tensors (the stack writes through the object); in Python, the
    hierarchical cache's fp_k/fp_v are assigned to only in its fallback writer (`_put`, off
    the C++ kernels) and its bookkeeping (rotation, checkpoints, a prefill's recent tokens,
    bulk and snapshot loads)."""
    for source in (ROOT / "kernels" / "cpu").glob("*.cpp"):
        copies = re.findall(r"\.copy_\(", source.read_text())
        assert not copies or source.name == "kv_cache.cpp", source.name
    allowed = {"_put", "_rotate", "restore", "set_recent", "load_full_precision", "load_state"}
    cache = ROOT / "qspec_core" / "cache"
    halves = ("hierarchical.py", "hier_planes.py")  # (the cache, and its storage methods)
    tree = ast.Module([*(ast.parse((cache / h).read_text()).body for h in halves)], [])
    tree.body = [node for body in tree.body for node in body]
    writers = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                text = ast.unparse(target)
                if "fp_k[" in text or "fp_v[" in text or "getattr(self, name)[" in text:
                    writers.add(func.name)
    assert writers <= allowed, writers
    # the fallback writer: `_put`, through the caches' shared `protocol.write_kv`
    (put,) = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_put"]
    assert "write_kv(self.native, self.fp_k, self.fp_v" in ast.unparse(put)
    for name in ("qspec_core", "kernels"):
        for source in (ROOT / name).rglob("*.py"):
            if source.name in halves:
                continue
            assert not re.search(r"\.fp_[kv]\[[^\]]*\]\s*=[^=]", source.read_text()), source
