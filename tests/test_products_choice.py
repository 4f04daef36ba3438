"""The QuantSpec prefill attention's products, chosen by measurement once per machine
(`qspec_core/runner/products_choice.py`), and what takes them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fresh_machine_choice, run_qspec

from kernels.cpu import attention as cpu_attention
from kernels.cpu import build as cpu_ext
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.cache.prefill import ChunkedPrefill
from qspec_core.config import ModelConfig
from qspec_core.errors import QspecError
from qspec_core.runner import products_choice
from qspec_core.runner.kernel_table import prefill_attention

needs_kernels = pytest.mark.skipif(not cpu_ext.available(), reason="C++ kernels unavailable")


@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    """An empty qspec cache, no override, no choice remembered by this process."""
    yield from fresh_machine_choice(products_choice, monkeypatch, tmp_path)


@needs_kernels
def test_products_are_measured_once_and_kept_per_machine(fresh_choice, monkeypatch):
    timings = iter([{"fp32": 2.0, "int16": 1.0}, {"fp32": 1.0, "int16": 2.0}])
    calls = []
    monkeypatch.setattr(products_choice, "measure", lambda: calls.append(1) or next(timings))
    assert products_choice.prefill_products() == "int16"
    kept = json.loads((fresh_choice / products_choice.FILE).read_text())
    assert kept[products_choice.machine_key()] == {
        "path": "int16",
        "seconds": {"fp32": 2.0, "int16": 1.0},
    }
    products_choice._measured_choice.cache_clear()  # a later process: reads, never re-measures
    assert products_choice.prefill_products() == "int16" and len(calls) == 1
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another key: measured anew
    assert products_choice.prefill_products() == "fp32" and len(calls) == 2
    assert len(json.loads((fresh_choice / products_choice.FILE).read_text())) == 2


@needs_kernels
def test_a_kept_name_that_is_no_candidate_is_measured_over(fresh_choice, monkeypatch):
    """A file edited by hand (or by an older qspec) to name "bf16", the ten-times-coarser
    products, or nonsense, is not obeyed: the machine measures again."""
    for kept in ("bf16", "fp64", 7, None):
        products_choice._measured_choice.cache_clear()
        table = {products_choice.machine_key(): {"path": kept}}
        (fresh_choice / products_choice.FILE).write_text(json.dumps(table))
        monkeypatch.setattr(products_choice, "measure", lambda: {"fp32": 1.0, "int16": 3.0})
        assert products_choice.prefill_products() == "fp32"
    (fresh_choice / products_choice.FILE).write_text("{broken")
    products_choice._measured_choice.cache_clear()
    assert products_choice.prefill_products() == "fp32"
    assert json.loads((fresh_choice / products_choice.FILE).read_text())  # rewritten, whole


def test_override_and_bad_values(fresh_choice, monkeypatch):
    monkeypatch.setattr(products_choice, "measure", lambda: pytest.fail("measured"))
    for value in ("fp32", " INT16 ", "bf16", "bf16-values"):
        monkeypatch.setenv(products_choice.ENV, value)
        forced = value.strip().lower()
        assert products_choice.override() == forced
        expect = forced if forced in cpu_attention.built_products() else "fp32"
        assert products_choice.prefill_products() == expect
    monkeypatch.setenv(products_choice.ENV, "int8")
    with pytest.raises(QspecError, match="QSPEC_PREFILL_PRODUCTS"):
        products_choice.override()
    for value in ("auto", " ", ""):
        monkeypatch.setenv(products_choice.ENV, value)
        assert products_choice.override() is None


def test_without_the_kernels_the_prefill_is_fp32_and_nothing_is_measured(fresh_choice, monkeypatch):
    monkeypatch.setenv("QSPEC_CPU_KERNELS", "0")
    monkeypatch.setattr(products_choice, "measure", lambda: pytest.fail("measured"))
    assert cpu_attention.built_products() == ()
    assert products_choice.prefill_products() == "fp32"


@needs_kernels
def test_measure_times_each_candidate_this_build_has():
    seconds = products_choice.measure((2, 1, 64, 32, 64), repeats=1)
    built = cpu_attention.built_products()
    assert set(seconds) == {p for p in products_choice.CANDIDATES if p in built}
    assert "fp32" in seconds and all(0 < s < 10 for s in seconds.values())
    assert "bf16" not in seconds  # (only when asked for: ten times the KL, docs/PERF.md)


def _prefill(config: ModelConfig, monkeypatch) -> tuple[list[str | None], torch.Tensor]:
    """A 2-chunk prefill of one layer through ChunkedPrefill, given the products the engine
    gives it (the runner's choice, `kernel_table.prefill_attention`): the products the tiled
    kernel was asked for on each call, and the second chunk's attention."""
    asked = []
    real = cpu_attention.prefill_attention

    def spy(q, k, v, start, products=None, window=None, softcap=None):
        asked.append(products)
        return real(q, k, v, start, products, window, softcap)

    monkeypatch.setattr(cpu_attention, "prefill_attention", spy)
    cache = HierarchicalKVCache(config, max_seq_len=256, group_size=32, dtype=torch.float32)
    prefill = ChunkedPrefill(cache, 64, prefill_attention("hierarchical", "cpu"))
    gen = torch.Generator().manual_seed(1)
    H, n_kv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = None
    for start in (0, 64):
        q = torch.randn(1, H, 64, D, generator=gen)
        k, v = (torch.randn(1, n_kv, 64, D, generator=gen) for _ in range(2))
        out = prefill.attend(0, q, k, v, torch.arange(start, start + 64))
    return asked, out


@needs_kernels
def test_the_chunked_prefill_asks_for_the_chosen_products(fresh_choice, monkeypatch):
    config = ModelConfig(
        vocab_size=32, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    )  # fmt: skip
    monkeypatch.setattr(products_choice, "measure", lambda: {"fp32": 1.0, "int16": 0.5})
    asked, measured = _prefill(config, monkeypatch)
    assert asked == ["int16", "int16"]
    monkeypatch.setenv(products_choice.ENV, "fp32")  # the override wins over the kept choice
    asked, fp32 = _prefill(config, monkeypatch)
    assert asked == ["fp32", "fp32"]
    if "int16" in cpu_attention.built_products():  # (int16 rounds: close to fp32, not equal)
        assert not torch.equal(measured, fp32)
        assert (measured - fp32).abs().max() < 2e-2 * fp32.abs().max()


@needs_kernels
def test_bench_and_summaries_name_the_measured_products(fresh_choice, monkeypatch):
    from qspec_core.bench.runner import _prefill_products

    monkeypatch.setattr(products_choice, "measure", lambda: {"fp32": 0.5, "int16": 1.0})
    assert _prefill_products() == "fp32"


def test_the_cli_refuses_bad_products_before_loading(tmp_path):
    import os

    env = dict(os.environ, QSPEC_PREFILL_PRODUCTS="int8", QSPEC_HOME=str(tmp_path / "home"))
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    done = run_qspec("summarize", doc, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: QSPEC_PREFILL_PRODUCTS is auto or one of 'fp32', 'sdpa', 'bf16', 'bf16-values', "
        "'int16', not 'int8'"
    ]
    assert not (tmp_path / "home").exists()  # (nothing made: refused before the cache)


@needs_kernels
def test_torch_sdpa_is_a_candidate_of_every_build_and_computes_the_fp32_numbers():
    """ "sdpa" (torch's own path) is timed beside the tiled kernel on every build, so no CPU
    prefills slower than torch would; it gives the tiled fp32 kernel's numbers to rounding."""
    assert {"fp32", "sdpa"} <= set(cpu_attention.built_products())
    assert set(products_choice.EXACT) <= set(products_choice.CANDIDATES)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, 40, 64, generator=gen)
    k, v = (torch.randn(1, 2, 100, 64, generator=gen) for _ in range(2))  # (S past start + T)
    sdpa = cpu_attention.prefill_attention(q, k, v, 30, "sdpa")
    tiled = cpu_attention.prefill_attention(q, k, v, 30, "fp32")
    torch.testing.assert_close(sdpa, tiled, rtol=1e-5, atol=1e-5)
    from kernels.reference import causal_attention

    want = causal_attention(q, k[:, :, :70], v[:, :, :70], torch.arange(30, 70))
    assert torch.equal(sdpa, want)


@needs_kernels
def test_the_full_precision_cache_takes_the_faster_fp32_path(fresh_choice, monkeypatch):
    """ar's cache (the engine's, `DecodePlan.new_cache`) computes the fp32 numbers on whichever
    of the tiled kernel and SDPA measured faster, from the same measurement as the QuantSpec
    prefill's products (int16 is never taken there: it rounds)."""
    from types import SimpleNamespace

    from qspec_core.engine.plan import DecodePlan
    from qspec_core.precision import FP

    monkeypatch.setattr(
        products_choice, "measure", lambda: {"fp32": 3.0, "sdpa": 2.0, "int16": 1.0}
    )
    assert products_choice.prefill_products() == "int16"
    assert products_choice.exact_products() == "sdpa"
    asked = []
    real = cpu_attention.prefill_attention
    monkeypatch.setattr(
        cpu_attention,
        "prefill_attention",
        lambda q, k, v, start, products=None, window=None, softcap=None: (
            asked.append(products) or real(q, k, v, start, products, window, softcap)
        ),
    )
    config = ModelConfig(
        vocab_size=32, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    )  # fmt: skip
    model = SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cpu"))
    cache = DecodePlan(target=FP).new_cache(model, 128)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 32, 64, generator=gen)
    k, v = (torch.randn(1, 1, 32, 64, generator=gen) for _ in range(2))
    cache.attend(0, q, k, v, torch.arange(32))
    assert asked == ["sdpa"]
    products_choice._measured_choice.cache_clear()
    monkeypatch.setattr(products_choice, "measure", lambda: pytest.fail("measured twice"))
    assert products_choice.exact_products() == "sdpa"  # (kept with its timings)
    monkeypatch.setenv("QSPEC_HOME", str(fresh_choice / "elsewhere"))  # (nothing kept there)
    q, k, v = (t[:, :, :5] for t in (q, k, v))
    cache.attend(0, q, k, v, torch.arange(32, 37))  # a verify step: neither path, no measurement
    assert asked == ["sdpa"]


@needs_kernels
def test_the_choice_is_keyed_by_the_build_and_the_qspec_home(fresh_choice, monkeypatch, tmp_path):
    """Another instruction-set build times other code: another key. Another QSPEC_HOME in the
    same process reads (or measures into) its own file, not the first one's remembered choice."""
    key = products_choice.machine_key()
    with monkeypatch.context() as m:
        m.setattr(cpu_ext, "isa", lambda: "another build")
        assert products_choice.machine_key() != key
    monkeypatch.setattr(products_choice, "measure", lambda: {"fp32": 1.0, "sdpa": 2.0})
    assert products_choice.prefill_products() == "fp32"
    other = tmp_path / "other-home"
    monkeypatch.setenv("QSPEC_HOME", str(other))
    monkeypatch.setattr(products_choice, "measure", lambda: {"fp32": 2.0, "sdpa": 1.0})
    assert products_choice.prefill_products() == "sdpa"
    assert (other / products_choice.FILE).exists()
