"""INT8 verifier weights (Quasar): written by convert, loaded, exact speculation against them,
their perplexity cost on a real text, and snapshots that remember which weights made them."""

import json

import pytest
import torch

from qspec_core.convert.convert import add_int8_weights
from qspec_core.convert.folder import DRAFT_META
from qspec_core.engine.session import ChatSession
from qspec_core.errors import QspecError
from qspec_core.model.transformer import has_int8, linear_layers
from qspec_core.precision import FP, W8
from qspec_core.registry.runtime import load_runtime


@pytest.fixture(scope="module")
def tiny_int8(tiny_model_dir):
    return load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None,
                        target_weights="int8")  # fmt: skip


def test_convert_writes_int8_weights_and_their_metadata(tiny_model_dir):
    meta = json.loads((tiny_model_dir / DRAFT_META).read_text())
    assert meta["target_int8"]["scheme"].startswith("per-output-channel symmetric INT8")
    assert meta["target_int8"]["method"] == "rtn"  # converted without a calibration text
    rt = load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None)
    layers = linear_layers(rt.model)
    assert set(meta["target_int8"]["modules"]) == set(layers)
    assert has_int8(rt.model) and rt.target_weights == "full"
    for layer in layers.values():  # the INT8 weights are the RTN grid of the full ones
        w, deq = layer.weight.float(), layer.int8.dequantized_weight()
        step = w.abs().amax(1, keepdim=True) / 127
        assert ((w - deq).abs() <= step / 2 + 1e-7).all()


def test_int8_target_changes_the_logits(tiny_int8):
    model = tiny_int8.runner
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    from qspec_core.cache.full import FullPrecisionCache

    def logits(path):
        cache = FullPrecisionCache(model.config, 8, dtype=torch.float32)
        return model(ids, torch.arange(5), cache, path)

    assert tiny_int8.baseline == W8  # what --target-weights int8 runs for `ar`
    int8, full = logits(W8), logits(FP)
    assert not torch.allclose(int8, full)  # the option really switches the weights
    torch.testing.assert_close(int8, full, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("gamma", [2, 5])
def test_greedy_quantspec_with_int8_verify_equals_int8_target_ar(tiny_int8, gamma):
    doc = "The quick brown fox jumps over the lazy dog. " * 12
    replies = {}
    for mode in ("quantspec", "target-ar"):
        s = ChatSession(tiny_int8, doc, max_new_tokens=40, mode=mode, gamma=gamma)
        pieces = list(s.ask("Summarize."))
        replies[mode] = ("".join(pieces), s.last.new_tokens)
    assert replies["quantspec"] == replies["target-ar"]


def test_add_int8_weights_upgrades_an_older_folder(tmp_path, tiny_model_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "old"
    shutil.copytree(tiny_model_dir, old)
    meta = json.loads((old / DRAFT_META).read_text())
    del meta["target_int8"]
    (old / DRAFT_META).write_text(json.dumps(meta))
    tensors = {k: v for k, v in load_file(old / "draft.safetensors").items() if ".int8." not in k}
    save_file(tensors, old / "draft.safetensors")
    with pytest.raises(QspecError, match="no INT8 verifier weights"):
        load_runtime(str(old), dtype="fp32", log=lambda m: None, target_weights="int8")
    plain = load_runtime(str(old), dtype="fp32", log=lambda m: None)
    add_int8_weights(old, plain.model)
    rt = load_runtime(str(old), dtype="fp32", log=lambda m: None, target_weights="int8")
    assert rt.target_weights == "int8" and has_int8(rt.model)
    assert not list(old.glob(".*.tmp"))
    rtn = {k: v for k, v in load_file(old / "draft.safetensors").items() if ".int8." in k}
    # upgrading RTN INT8 weights to GPTQ ones replaces them and keeps the draft
    calib = list(range(100, 300))
    add_int8_weights(old, plain.model, calib, "ids 100..299")
    meta = json.loads((old / DRAFT_META).read_text())
    assert meta["target_int8"]["method"] == "gptq"
    assert meta["target_int8"]["calibration"] == "ids 100..299"
    after = load_file(old / "draft.safetensors")
    assert {k for k in after if ".int8." not in k} == {k for k in tensors}
    assert rtn.keys() == {k for k in after if ".int8." in k}
    assert any(not torch.equal(rtn[k], after[k]) for k in rtn if k.endswith("weight_int8"))
    assert all(torch.equal(rtn[k], after[k]) for k in rtn if k.endswith("weight_scale"))


def test_snapshot_remembers_the_target_weights(tiny_model_dir):
    from qspec_core.store.snapshot import check_compatible

    rt = load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None)
    from qspec_core.store.snapshot import model_fingerprint, tokenizer_fingerprint

    manifest = {
        "model": "tiny",
        "model_fingerprint": model_fingerprint(tiny_model_dir),
        "tokenizer_fingerprint": tokenizer_fingerprint(tiny_model_dir),
        "quantization": {"group_size": rt.model.config.head_dim},
        "target_weights": "int8",
    }
    with pytest.raises(QspecError, match="--target-weights int8"):
        check_compatible(manifest, tiny_model_dir, None, rt.model)
    check_compatible(manifest, tiny_model_dir, None, rt.model, target_weights="int8")


@pytest.mark.real_model
def test_int8_weights_perplexity_cost_is_small(default_converted):
    """The issue asks for <= 1%. Round-to-nearest INT8 cost ~1% (+1.09% on these 768 tokens);
    GPTQ's rounding brings it under (docs/PERF.md)."""
    from qspec_core.bench.corpus import DATA
    from qspec_core.bench.quality import measure_kv_quality
    from qspec_core.documents import read_document

    rt = load_runtime(None, dtype="fp32", log=lambda m: None, need_draft=True)
    before = {n: t.data_ptr() for n, t in rt.model.state_dict().items()}
    ids = rt.tokenizer.encode(read_document(DATA / "apache-2.0.txt"))[:768]
    q = measure_kv_quality(rt.model, ids, runner=rt.runner)
    assert {"w8", "w8-target"} <= q.perplexity.keys()
    for name in ("w8", "w8-target"):
        assert q.perplexity[name] != q.perplexity["fp"]
        assert abs(q.perplexity[name] / q.perplexity["fp"] - 1) < 0.01, q.perplexity
    after = {n: t.data_ptr() for n, t in rt.model.state_dict().items()}
    assert after == before  # measuring leaves the model as it was


def test_a_snapshot_prefill_runs_on_the_target_weights(tiny_int8):
    """`qspec prefill --target-weights int8` stores KV computed by the INT8 weights (the KV a
    later verify on them reads), not by the checkpoint's."""
    from qspec_core.cache.hierarchical import HierarchicalKVCache
    from qspec_core.engine.generate import prefill_hierarchical

    doc = "The quick brown fox jumps over the lazy dog. " * 12
    cache, ids = ChatSession(tiny_int8, doc, mode="quantspec").prefill_document()
    states = {}
    for weights in ("int8", "full"):
        own = HierarchicalKVCache(tiny_int8.model.config, cache.max_seq_len, dtype=torch.float32)
        prefill_hierarchical(tiny_int8.runner, own, ids, weights=weights)  # (as the session)
        states[weights] = own.state()
    got = cache.state()
    assert all(torch.equal(got[k], t) for k, t in states["int8"].items())
    assert not all(torch.equal(got[k], t) for k, t in states["full"].items())


def test_auto_continues_on_a_snapshots_target_weights_and_names_them_when_it_cannot(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`--target-weights auto` with a snapshot takes the weights that made its KV; when this
    run cannot use them, the error names the snapshot's setting, not a flag nobody passed."""
    from qspec_cli import common
    from qspec_core.store import snapshot

    monkeypatch.setattr(snapshot, "read_manifest", lambda path: {"target_weights": "int4"})
    with pytest.raises(QspecError, match=r"s\.qspec was made with --target-weights int4, which"):
        common.load_session(
            str(tiny_model_dir), "fp32", None, "auto", tmp_path / "s.qspec", None, mode="ar"
        )
