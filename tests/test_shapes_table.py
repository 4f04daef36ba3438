"""benchmarks/shapes_table.py: every shape's tensors are the parameters qspec builds from its
config, and each family's Llama twin holds the same matrices (the bench compares their speed,
so a twin of other bytes would compare nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def table(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import shapes_table

    return shapes_table


def test_every_shape_is_what_qspec_builds(table):
    for shape in table.SHAPES.values():
        config = table.check_with_qspec(shape, table.tensors(shape))
        assert config.num_hidden_layers == shape.config["num_hidden_layers"]


def test_each_family_has_a_llama_twin_of_the_same_matrices(table):
    twins = [s for s in table.SHAPES if s.startswith("llama-as-")]
    assert {"llama-as-qwen3-0.6b", "llama-as-gemma-3-1b", "llama-as-olmo-2-1b"} <= set(twins)
    for name in twins:
        family, twin = table.SHAPES[name.removeprefix("llama-as-")], table.SHAPES[name]
        assert twin.arch == "llama" and family.arch != "llama"

        def matrices(shape):
            return sorted(t.shape for t in table.tensors(shape) if len(t.shape) == 2)

        assert matrices(family) == matrices(twin), name
        # the families' norms (q/k, sandwich) are the only other parameters: < 0.1%
        extra = sum(t.numel for t in table.tensors(family)) - sum(
            t.numel for t in table.tensors(twin)
        )
        assert 0 <= extra < 1e-3 * sum(t.numel for t in table.tensors(twin))


def test_gemma_norms_are_about_zero_and_the_others_one(table):
    gemma = {t.name: t for t in table.tensors(table.SHAPES["gemma-3-1b"])}
    qwen3 = {t.name: t for t in table.tensors(table.SHAPES["qwen3-0.6b"])}
    # Gemma scales by 1 + weight: a weight of 1 would double every norm's output
    assert not gemma["model.layers.0.pre_feedforward_layernorm.weight"].ones
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].ones
    assert not table.SHAPES["qwen3-0.6b"].gguf and table.SHAPES["qwen2.5-0.5b"].gguf
