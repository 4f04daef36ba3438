"""The bench's compute probe (`qspec_core/bench/compute.py`): the prefill FLOPs it divides by
are counted right, and the probe measures what it names."""

import pytest
import torch

from qspec_core.bench import compute
from qspec_core.config import ModelConfig
from qspec_core.model.transformer import Transformer, linear_layers

CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def test_linear_flops_are_the_model_weights_times_two_per_token():
    """Against the model's own linears (a miscounted projection or MLP width moves it)."""
    model = Transformer(CONFIG)
    weights = {n: layer.weight.numel() for n, layer in linear_layers(model).items()}
    tokens = 37
    want = 2 * tokens * sum(v for n, v in weights.items() if n != "lm_head")
    head = 2 * weights.get("lm_head", CONFIG.vocab_size * CONFIG.hidden_size)  # (a row)
    assert compute.prefill_flops(CONFIG, tokens)["linears"] == want + head  # (one chunk)
    # a row through the head per chunk: each chunk computes its last position's logits
    assert compute.prefill_flops(CONFIG, tokens, chunk=16)["linears"] == want + 3 * head


@pytest.mark.parametrize("tokens,start", [(1, 0), (5, 0), (7, 11), (64, 3)])
def test_attention_flops_count_the_causal_pairs(tokens, start):
    """Q K^T and P V over exactly the (query, key) pairs a causal mask keeps, brute-forced."""
    total = tokens + start
    mask = torch.ones(total, total).tril()[start:]  # the new queries' rows
    pairs = int(mask.sum())
    want = 2 * 2 * CONFIG.head_dim * pairs * CONFIG.num_attention_heads
    want *= CONFIG.num_hidden_layers
    assert compute.prefill_flops(CONFIG, tokens, start)["attention"] == want


@pytest.mark.parametrize("tokens,start", [(1, 0), (5, 0), (7, 11), (64, 3), (40, 100)])
@pytest.mark.parametrize("window", [1, 6, 20])
def test_a_local_layers_attention_flops_count_its_windows_pairs(tokens, start, window):
    """A sliding-window layer (Gemma 3's pattern: layers 0 and 1 local, 2 global) counts the
    pairs its windowed mask keeps, brute-forced; the global layer all causal pairs."""
    from dataclasses import replace

    config = replace(
        CONFIG,
        sliding_window=window,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    )
    assert config.windows == (window, window, None)
    pos = torch.arange(start, start + tokens)[:, None]
    keys = torch.arange(start + tokens)[None, :]
    local = int(((keys <= pos) & (keys > pos - window)).sum())
    causal = int((keys <= pos).sum())
    want = 2 * 2 * CONFIG.head_dim * CONFIG.num_attention_heads * (2 * local + causal)
    assert compute.prefill_flops(config, tokens, start)["attention"] == want


def test_probe_measures_each_element_type_and_the_line_divides_by_the_best():
    peaks = compute.gemm_peaks(shape=(64, 128, 128))
    assert set(peaks) == {"fp32", "bf16", "int8"}
    assert peaks["fp32"] > 0 and peaks["bf16"] > 0
    assert peaks["int8"] is None or peaks["int8"] > 0  # (a build may lack the int8 GEMM)
    flops = {"linears": 3e9, "attention": 1e9}
    line = compute.prefill_compute(2.0, flops, {"fp32": 4e9, "bf16": 8e9, "int8": None})
    assert line["gflop"] == 4.0 and line["gflop_s"] == 2.0
    assert line["fraction_of_peak"] == 0.25
    assert compute.prefill_compute(1.0, flops, {"fp32": None})["fraction_of_peak"] is None
    # per stage: the attention's FLOPs over its seconds, the linears' over the rest
    staged = compute.prefill_compute(2.0, flops, {"fp32": 4e9}, {"attention": 0.5, "quantize": 0.5})
    assert staged["attention_gflop_s"] == 2.0 and staged["attention_fraction_of_peak"] == 0.5
    assert staged["linears_s"] == 1.0 and staged["linears_gflop_s"] == 3.0
    assert staged["quantize_s"] == 0.5 and "other_s" not in staged
    # with the linears timed (the CPU runner): their FLOPs over their own seconds, the rest
    # (norms, RoPE, Python) apart
    timed = {"attention": 0.5, "quantize": 0.5, "linears": 0.75}
    staged = compute.prefill_compute(2.0, flops, {"fp32": 4e9}, timed)
    assert staged["linears_s"] == 0.75 and staged["linears_gflop_s"] == 4.0
    assert staged["linears_fraction_of_peak"] == 1.0 and staged["other_s"] == 0.25


def test_two_slow_first_products_are_the_measurement(monkeypatch):
    """bf16 on a CPU without BF16 units: two calls (the first may have stalled behind another
    process), not a timed loop of seconds each."""
    calls = []
    real = compute._operands

    def counted(*args):
        run = real(*args)
        return lambda: calls.append(1) or run()

    monkeypatch.setattr(compute, "_operands", counted)
    monkeypatch.setattr(compute, "SLOW_S", 0.0)
    assert compute.gemm_rate("fp32", (32, 64, 64), seconds=5.0) > 0
    assert len(calls) == 2
