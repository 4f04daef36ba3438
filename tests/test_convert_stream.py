"""The layer-by-layer conversion (`convert/stream.py`) makes the whole-model conversion's
folder (`convert.convert`): the same twins bit for bit, the same report, for every method,
recipe and family; and holds one layer's weights at a time."""

import json

import pytest
import torch
from hf_tiny import tiny_hf
from safetensors.torch import load_file
from test_families import _hf

from qspec_core.convert import stream
from qspec_core.convert.convert import convert
from qspec_core.convert.recipes import get_recipe
from qspec_core.convert.tensor_file import TensorFileWriter, header_room
from qspec_core.errors import QspecError
from qspec_core.model.checkpoint import load_model


def _calib(n: int, vocab: int = 101) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _both(folder, tmp_path, **options) -> tuple[dict, dict, dict, dict]:
    """(tensors, meta) of the whole-model, then of the streamed conversion of `folder`."""
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    convert(folder, whole, load_model(folder, dtype=torch.float32), **options)
    stream.convert_streaming(folder, streamed, **options)
    out = []
    for f in (whole, streamed):
        meta = json.loads((f / "qspec_draft.json").read_text())
        out += [load_file(f / "draft.safetensors"), meta]
    return tuple(out)


def _same(a: dict, meta_a: dict, b: dict, meta_b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for key in ("method", "group_size", "modules", "target_int8", "calibration", "sym"):
        assert meta_a[key] == meta_b[key], key
    ra, rb = meta_a["report"], meta_b["report"]
    assert ra["rel_weight_error"] == rb["rel_weight_error"]
    assert ra["top1_agreement"] == rb["top1_agreement"]
    assert ra["kl"] == pytest.approx(rb["kl"], rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_hf("llama", hidden_size=64, intermediate_size=128, vocab_size=101).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "options",
    [
        dict(method="rtn", group_size=32, calib_ids=_calib(200)),
        dict(method="gptq", group_size=32, calib_ids=_calib(700)),  # (two chunks, report apart)
        dict(method="awq", group_size=32, calib_ids=_calib(100)),
        dict(method="rtn", group_size=32),  # (no calibration: RTN INT8, no report)
        dict(method="rtn", group_size=32, calib_ids=_calib(40)),  # (a report, no Hessians)
        dict(calib_ids=_calib(150), recipe=get_recipe("gptq-mlp")),
        dict(calib_ids=_calib(150), recipe=get_recipe("int8-upper")),
    ],
    ids=["rtn", "gptq-2-chunks", "awq", "rtn-uncalibrated", "rtn-short", "gptq-mlp", "upper"],
)
def test_streamed_equals_whole(llama_folder, tmp_path, options):
    _same(*_both(llama_folder, tmp_path, **options))


@pytest.mark.parametrize("case", ["qwen2", "olmo2", "phi3", "gemma3_text", "gemma2"])
def test_streamed_equals_whole_per_family(case, tmp_path):
    """Biases, post and sandwich norms, fused tensors, local RoPE layers, soft caps."""
    _hf(case).save_pretrained(tmp_path / "hf")
    _same(*_both(tmp_path / "hf", tmp_path, method="gptq", group_size=32, calib_ids=_calib(90)))


def test_tied_embeddings(tmp_path):
    tiny_hf("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "hf")
    _same(*_both(tmp_path / "hf", tmp_path, method="rtn", group_size=32, calib_ids=_calib(80)))


def test_a_head_of_several_blocks(llama_folder, tmp_path, monkeypatch):
    """lm_head quantized in row blocks: the RTN twins are those of the whole head (RTN's rows
    are independent, as are GPTQ's but for the BLAS's rounding), the report within noise."""
    monkeypatch.setattr(stream, "HEAD_BLOCK_BYTES", 4 * 64 * 30)  # 30 of 101 rows a block
    a, meta_a, b, meta_b = _both(llama_folder, tmp_path, method="rtn", group_size=32,
                                 calib_ids=_calib(120))  # fmt: skip
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ra, rb = meta_a["report"], meta_b["report"]
    assert ra["rel_weight_error"] == pytest.approx(rb["rel_weight_error"], rel=1e-5)
    assert ra["kl"] == pytest.approx(rb["kl"], rel=1e-4)


def test_one_layer_at_a_time(llama_folder, tmp_path, monkeypatch):
    """While a layer is converted, every other decoder layer is on the meta device."""
    seen = []
    real = stream._Plan.layer

    def spy(self, layer, prefix, streams, rope):
        model_layers = spy.skeleton.layers
        real_ones = [
            i for i, m in enumerate(model_layers) if m.input_layernorm.weight.is_meta is False
        ]
        seen.append(real_ones)
        return real(self, layer, prefix, streams, rope)

    real_load = stream._load_layer

    def load(skeleton, reader, i):
        spy.skeleton = skeleton
        return real_load(skeleton, reader, i)

    monkeypatch.setattr(stream, "_load_layer", load)
    monkeypatch.setattr(stream._Plan, "layer", spy)
    stream.convert_streaming(llama_folder, tmp_path / "o", "rtn", 32, _calib(100))
    assert seen == [[0], [1]]


def test_checks_before_work(llama_folder, tmp_path):
    config = json.loads((llama_folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in llama_folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1_000_000_000}))
    with pytest.raises(QspecError, match="does not match its config.json"):
        stream.convert_streaming(bad, tmp_path / "o", "rtn", 32)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o-*"))
    with pytest.raises(QspecError, match="group size must be an even number"):
        stream.convert_streaming(llama_folder, tmp_path / "o", "rtn", 3)
    with pytest.raises(QspecError, match="at least 64 tokens"):
        stream.convert_streaming(llama_folder, tmp_path / "o", "gptq", 32, _calib(10))


def test_an_interrupted_conversion_leaves_nothing(llama_folder, tmp_path, monkeypatch):
    def boom(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(stream, "_write", boom)
    with pytest.raises(KeyboardInterrupt):
        stream.convert_streaming(llama_folder, tmp_path / "o", "rtn", 32, _calib(100))
    assert list(tmp_path.iterdir()) == []


def test_the_tensor_file_writer(tmp_path):
    tensors = {
        "a.int8.weight_int8": torch.randint(-127, 128, (5, 7), dtype=torch.int8),
        "a.int8.weight_scale": torch.rand(5),
        "b.draft.packed": torch.randint(0, 255, (3, 4), dtype=torch.uint8),
        "c": torch.randn(2, 3).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "t.safetensors"
    writer = TensorFileWriter(path, header_room(tensors, {"format": "x"}))
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close({"format": "x"})
    back = load_file(path)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    writer = TensorFileWriter(tmp_path / "small.safetensors", 16)
    writer.add("a", torch.zeros(1))
    with pytest.raises(ValueError, match="reserved"):
        writer.close()


def test_int8_to_nearest_needs_no_calibration(llama_folder, tmp_path, monkeypatch):
    """--int8 rtn with an RTN draft collects no Hessian: the INT8 twins are round-to-nearest
    (those of a conversion without a calibration text), and the report is still made."""
    added = []
    real = stream.HessianCollector.add
    monkeypatch.setattr(
        stream.HessianCollector, "add", lambda self, n, x: added.append(n) or real(self, n, x)
    )
    stream.convert_streaming(
        llama_folder, tmp_path / "a", "rtn", 32, _calib(100), int8_method="rtn"
    )
    assert added == []
    stream.convert_streaming(llama_folder, tmp_path / "b", "rtn", 32)  # (no text at all)
    a, b = (load_file(tmp_path / f / "draft.safetensors") for f in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    meta = json.loads((tmp_path / "a" / "qspec_draft.json").read_text())
    assert meta["target_int8"]["method"] == "rtn" and meta["report"]["top1_agreement"] > 0
    with pytest.raises(QspecError, match="INT8 rounding"):
        stream.convert_streaming(llama_folder, tmp_path / "c", "rtn", 32, int8_method="awq")
