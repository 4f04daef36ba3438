"""The library work the CLI calls instead of doing itself: conversion steps and metadata, the
GPTQ export's folder, KV cache sizes, and the summary record."""

import json
from types import SimpleNamespace

import pytest
import torch
from hf_tiny import tiny_hf

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.sizes import full_kv_bytes
from qspec_core.config import ModelConfig
from qspec_core.convert.convert import DraftReport, convert
from qspec_core.convert.export import TOKENIZER_FILES, export_gptq_folder
from qspec_core.convert.info import convert_steps, read_draft_meta, weight_error_summary
from qspec_core.convert.recipes import get_recipe
from qspec_core.engine.session import ReplyStats
from qspec_core.engine.speculative import SpecStats
from qspec_core.engine.summary import TARGET_DISTRIBUTION, reproduces, summary_record
from qspec_core.errors import QspecError
from qspec_core.model.checkpoint import load_model

# ----------------------------------------------------------------------------- cache sizes


@pytest.mark.parametrize("dtype,element_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_full_kv_bytes_is_what_a_full_cache_holds(dtype, element_bytes):
    config = ModelConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    cache = FullPrecisionCache(config, 37, dtype=dtype)  # 37 positions, preallocated
    held = cache.k.nbytes + cache.v.nbytes
    assert full_kv_bytes(config, 37, element_bytes) == held
    if element_bytes == 2:
        assert full_kv_bytes(config, 37) == held  # bf16 by default


def test_full_kv_bytes_of_the_default_model():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 -> 2 * 30 * 3 * 64 * 2 bytes per token
    config = ModelConfig(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    assert full_kv_bytes(config, 1) == 23040
    assert full_kv_bytes(config, 1000) == 23_040_000
    assert full_kv_bytes(config, 0) == 0


# ----------------------------------------------------------------------------- convert


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random Llama folder with two of the tokenizer files a GPTQ export carries."""
    folder = tmp_path_factory.mktemp("tiny-src")
    tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=128).save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"model": "tiny"}')
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


def _counted_convert(source, out, **kwargs) -> tuple[int, int, DraftReport, torch.nn.Module]:
    """(on_layer calls, convert_steps counted first, report, the model now carrying its
    drafts) of one conversion of a fresh model."""
    model = load_model(source, dtype=torch.float32)
    steps = convert_steps(model, draft="draft_from" not in kwargs)  # as the CLI: before converting
    calls = []
    report = convert(source, out, model, "rtn", 32, on_layer=calls.append, **kwargs)
    return len(calls), steps, report, model


def test_convert_steps_count_every_progress_call(source, tmp_path):
    calls, steps, _, model = _counted_convert(source, tmp_path / "conv")
    assert calls == steps == 2 * (2 * 7 + 1)  # a draft and INT8 weights for 15 linears
    exported = export_gptq_folder(model, source, tmp_path / "gptq")
    calls, steps, _, _ = _counted_convert(source, tmp_path / "imported", draft_from=exported)
    assert calls == steps == 2 * 7 + 1  # an imported draft: the INT8 weights only


def test_convert_steps_count_a_recipes_layers(source, tmp_path):
    model = load_model(source, dtype=torch.float32)
    recipe = get_recipe("gptq-head8")
    steps = convert_steps(model, True, recipe)
    calls = []
    calib = list(range(100))
    convert(source, tmp_path / "conv", model, calib_ids=calib, recipe=recipe, on_layer=calls.append)
    assert len(calls) == steps == 15 + 14  # INT8 weights for 15 linears, a draft for 14


def test_gptq_export_carries_config_and_tokenizer_files(source, tmp_path):
    model = load_model(source, dtype=torch.float32)
    convert(source, tmp_path / "conv", model, "rtn", 32)  # attaches the drafts to `model`
    exported = export_gptq_folder(model, source, tmp_path / "gptq")
    assert exported == tmp_path / "gptq"
    config = json.loads((exported / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert (exported / "tokenizer.json").read_text() == '{"model": "tiny"}'
    assert (exported / "chat_template.jinja").read_text() == "{{ messages }}"
    for name in set(TOKENIZER_FILES) - {"tokenizer.json", "chat_template.jinja"}:
        if not (source / name).exists():
            assert not (exported / name).exists(), name  # nothing made up


def test_read_draft_meta(source, tmp_path):
    _, _, report, _ = _counted_convert(source, tmp_path / "conv")
    meta = read_draft_meta(tmp_path / "conv")
    assert meta["method"] == "rtn" and meta["group_size"] == 32 and meta["bits"] == 4
    assert len(meta["modules"]) == 15 and "lm_head" in meta["modules"]
    assert meta["report"]["rel_weight_error"] == pytest.approx(report.rel_weight_error)
    with pytest.raises(QspecError, match="not a converted model"):
        read_draft_meta(source)
    (tmp_path / "conv" / "qspec_draft.json").write_text("{broken")
    with pytest.raises(QspecError, match="corrupt"):
        read_draft_meta(tmp_path / "conv")
    (tmp_path / "conv" / "qspec_draft.json").write_text("[1, 2]")
    with pytest.raises(QspecError, match="expected a JSON object, not list"):
        read_draft_meta(tmp_path / "conv")


def test_weight_error_summary():
    report = DraftReport(rel_weight_error={"a": 0.1, "b": 0.3, "c": 0.3, "d": 0.2})
    mean, worst, error = weight_error_summary(report)
    assert mean == pytest.approx(0.225)
    assert (worst, error) == ("b", 0.3)  # the first of equals
    with pytest.raises(ValueError):
        weight_error_summary(DraftReport())


# ----------------------------------------------------------------------------- summary record


def _session(mode: str, spec: SpecStats | None, device: str = "cpu"):
    stats = ReplyStats(
        prompt_tokens=120,
        prefilled_tokens=120,
        new_tokens=30,
        timings_s={"prefill": 0.5, "decode": 1.23456789},
        spec=spec,
    )
    runtime = SimpleNamespace(model=SimpleNamespace(device=torch.device(device)))
    return SimpleNamespace(
        last=stats, last_text="A summary.", mode=mode, truncated_tokens=7, gamma=4, runtime=runtime
    )


def test_summary_record_of_a_quantspec_reply(monkeypatch):
    monkeypatch.setenv("QSPEC_PREFILL_PRODUCTS", "fp32")
    spec = SpecStats(rounds=10, drafted=40, accepted=30, recovered=6, bonus=4)
    record = summary_record(_session("quantspec", spec), "tiny", "full")
    assert record.pop("peak_rss_bytes") > 50 << 20  # (this process: torch alone is more)
    assert record == {
        "text": "A summary.",
        "mode": "quantspec",
        "target_weights": "full",
        "reproduces": TARGET_DISTRIBUTION["full"],
        "prefill_products": "fp32",
        "model": "tiny",
        "prompt_tokens": 120,
        "new_tokens": 30,
        "tokens_per_s": round(30 / 1.23456789, 3),
        "prefill_tokens_per_s": 240.0,
        "truncated_tokens": 7,
        "timings_s": {"prefill": 0.5, "decode": 1.234568},
        "stats": spec.to_dict(4),
    }
    assert record["stats"]["acceptance_rate"] == 0.75 and record["stats"]["gamma"] == 4
    json.dumps(record)  # JSON-ready as is


def test_summary_record_without_speculation_has_no_stats():
    record = summary_record(_session("target-ar", None), "tiny", "int8")
    assert "stats" not in record
    assert record["reproduces"] == TARGET_DISTRIBUTION["int8"]


def test_summary_record_names_the_prefill_products(monkeypatch):
    """The measured (or forced) products of the QuantSpec prefill; ar's full-precision cache
    computes fp32 numbers unless QSPEC_PREFILL_PRODUCTS asks; none off the CPU."""
    from kernels.cpu import attention as cpu_attention
    from qspec_core.runner import products_choice

    monkeypatch.delenv("QSPEC_PREFILL_PRODUCTS", raising=False)
    measured = products_choice.prefill_products()
    assert summary_record(_session("quantspec", None), "t", "w8a8")["prefill_products"] == measured
    exact = products_choice.exact_products()  # (fp32 numbers: the kernel's or SDPA's)
    assert exact in products_choice.EXACT
    assert summary_record(_session("ar", None), "t", "w8a8")["prefill_products"] == exact
    assert summary_record(_session("ar", None, "meta"), "t", "w8a8")["prefill_products"] is None
    monkeypatch.setenv("QSPEC_PREFILL_PRODUCTS", "int16")
    forced = cpu_attention.prefill_products("int16") if cpu_attention.available() else "fp32"
    for mode in ("ar", "target-ar"):
        assert summary_record(_session(mode, None), "t", "w8a8")["prefill_products"] == forced


@pytest.mark.parametrize(
    "mode,weights,expected",
    [
        ("quantspec", "full", TARGET_DISTRIBUTION["full"]),
        ("target-ar", "int8", TARGET_DISTRIBUTION["int8"]),
        ("ar", "full", "the full-precision model"),
        ("ar", "int8", "the full-precision model with INT8 weights"),
    ],
)
def test_what_a_run_reproduces(mode, weights, expected):
    assert reproduces(mode, weights) == expected
