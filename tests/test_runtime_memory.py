"""A run on INT8 target weights holds what it reads: the linears' full weights are never read
(`load_runtime(full_weights=False)`), and it decodes what the runtime with them decodes."""

from pathlib import Path

import pytest
import torch

from kernels.cpu import build as cpu_ext
from qspec_core.engine.session import ChatSession
from qspec_core.errors import QspecError
from qspec_core.model.transformer import linear_layers
from qspec_core.registry.runtime import load_runtime

needs_kernels = pytest.mark.skipif(not cpu_ext.available(), reason="C++ kernels unavailable")


def _load(folder, full: bool, weights: str = "w8a8"):
    return load_runtime(str(folder), dtype="fp32", log=lambda m: None, need_draft=True,
                        target_weights=weights, full_weights=full)  # fmt: skip


@pytest.mark.parametrize("weights", ["w8a8", "int8"])
def test_int8_runs_do_not_read_the_full_weights(tiny_model_dir, weights, monkeypatch):
    from qspec_core.model import checkpoint

    read = []
    real = checkpoint.TensorFile.get_tensor
    monkeypatch.setattr(
        checkpoint.TensorFile, "get_tensor", lambda self, n, *a: read.append(n) or real(self, n, *a)
    )
    lean = _load(tiny_model_dir, False, weights)
    layers = linear_layers(lean.model)
    tied = lean.model.config.tie_word_embeddings
    for name, layer in layers.items():
        assert layer.int8 is not None
        assert layer.weight.is_meta != (name == "lm_head" and tied), name
    assert not any(n.endswith("proj.weight") for n in read)  # (not even read, then dropped)
    assert "full" not in lean.model.weight_sets and lean.target_weights == weights
    with pytest.raises(QspecError, match="without its full weights"):
        lean.to(dtype=torch.bfloat16)


def test_full_weights_are_read_where_the_run_needs_them(tiny_model_dir):
    for runtime in (_load(tiny_model_dir, True), _load(tiny_model_dir, False, "full")):
        assert "full" in runtime.model.weight_sets
        assert not any(la.weight.is_meta for la in linear_layers(runtime.model).values())


@needs_kernels
@pytest.mark.parametrize("mode", ["quantspec", "target-ar", "ar"])
def test_the_lean_runtime_writes_the_same_text(tiny_model_dir, mode):
    text = "The quick brown fox jumps over the lazy dog. " * 30
    outputs = []
    for full in (True, False):
        session = ChatSession(_load(tiny_model_dir, full), text, mode=mode, max_new_tokens=24)
        outputs.append("".join(session.ask("Summarize.")))
    assert outputs[0] == outputs[1] and outputs[0]


def test_the_embedding_stays_in_the_checkpoint_dtype_where_only_its_rows_are_read(tiny_model_dir):
    """With lm_head on its INT8 twin the table is only looked up by rows: a bf16 checkpoint's
    stays bf16 (half the bytes) and its rows are cast exactly; with the full weights it is
    lm_head's weight too, in the model's dtype."""
    from qspec_core.config import ModelConfig
    from qspec_core.convert.folder import int8_modules
    from qspec_core.model.checkpoint import LINEAR, build_model, load_state_dict

    config = ModelConfig.from_file(tiny_model_dir / "config.json")
    stored = load_state_dict(tiny_model_dir, torch.bfloat16)  # (a bf16 checkpoint)
    skipped = int8_modules(tiny_model_dir)
    assert "lm_head" in skipped
    gone = {f"{m}.{k}" for m in skipped for k in LINEAR if m != "lm_head"}
    lean = build_model(config, {k: t for k, t in stored.items() if k not in gone},
                       dtype=torch.float32, skipped=skipped)  # fmt: skip
    full = build_model(config, stored, dtype=torch.float32)
    assert lean.embed_tokens.weight.dtype == torch.bfloat16 and lean.dtype == torch.float32
    assert full.embed_tokens.weight.dtype == torch.float32 == full.lm_head.weight.dtype
    ids = torch.tensor([[0, 5, 17, config.vocab_size - 1]])
    assert lean.embed(ids).dtype == torch.float32 and torch.equal(lean.embed(ids), full.embed(ids))


@needs_kernels
@pytest.mark.parametrize("mode", ["target-ar", "quantspec"])
def test_a_full_weight_run_holds_only_the_twins_it_reads(tiny_model_dir, mode):
    """`--target-weights full`: target-ar holds no twin; quantspec the 4-bit draft and the
    INT8 twins of the layers that draft on them (no 4-bit twin); the same text as with all."""
    text = "The quick brown fox jumps over the lazy dog. " * 30
    need_draft = mode == "quantspec"
    outputs = []
    for full in (True, False):
        runtime = load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None,
                               need_draft=need_draft, target_weights="full",
                               full_weights=full)  # fmt: skip
        layers = linear_layers(runtime.model)
        if not full:
            for name, layer in layers.items():
                assert (layer.draft is not None) == need_draft or layer.draft is None, name
                reads_int8 = need_draft and layer.draft is None
                assert (layer.int8 is not None) == reads_int8, name
        session = ChatSession(runtime, text, mode=mode, max_new_tokens=24)
        outputs.append("".join(session.ask("Summarize.")))
    assert outputs[0] == outputs[1] and outputs[0]


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[-1].strip() for line in f if "/" in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_a_rows_only_embedding_is_memory_mapped_not_read(bf16_model_dir):
    """On INT8 weights the table is mapped from the checkpoint (only the pages of the rows
    looked up become resident: Llama 3.1 8B's is 1 GB) and holds the stored bits; with the
    full weights (lm_head reads all of it) it is read."""
    from qspec_core.model.checkpoint import EMBEDDING, CheckpointReader

    checkpoint = str((bf16_model_dir / "model.safetensors").resolve())
    stored = CheckpointReader(bf16_model_dir).get(EMBEDDING, None)
    lean = _load(bf16_model_dir, False)
    table = lean.model.embed_tokens.weight
    assert checkpoint in _mapped_files()
    assert table.dtype == torch.bfloat16 and torch.equal(table, stored)
    del lean, table
    import gc

    gc.collect()
    assert checkpoint not in _mapped_files()  # (the map goes with the model)
    full = _load(bf16_model_dir, True)
    assert checkpoint not in _mapped_files()
    assert torch.equal(full.model.embed_tokens.weight, stored.float())


@pytest.fixture
def bf16_model_dir(tiny_model_dir, tmp_path):
    """tiny_model_dir with its checkpoint stored in bf16 (as SmolLM2's and Qwen2.5's are)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, folder)
    for path in folder.glob("model*.safetensors"):
        state = {k: t.bfloat16() for k, t in load_file(path).items()}
        save_file(state, path, metadata={"format": "pt"})
    return folder


@needs_kernels
@pytest.mark.parametrize("mode", ["quantspec", "target-ar", "ar"])
def test_full_weights_are_held_in_the_checkpoints_bf16_with_the_same_text(
    bf16_model_dir, mode, monkeypatch
):
    """`--target-weights full` on a bf16 checkpoint holds its linears in bf16 (not fp32 plus a
    bf16 copy) where the kernels read bf16 rows exactly, and writes the fp32-held run's text."""
    from qspec_core.registry import runtime as runtime_module

    if not cpu_ext.load().BF16_WEIGHT_ROWS:
        pytest.skip("a portable build holds fp32 weights")
    text = "The quick brown fox jumps over the lazy dog. " * 30
    outputs = []
    for held in (True, False):
        monkeypatch.setattr(runtime_module, "holds_bf16", lambda device, held=held: held)
        runtime = _load(bf16_model_dir, True, "full")
        dtypes = {la.weight.dtype for la in linear_layers(runtime.model).values()}
        assert dtypes == {torch.bfloat16 if held else torch.float32}
        assert runtime.model.dtype == torch.float32
        session = ChatSession(runtime, text, mode=mode, max_new_tokens=24)
        outputs.append("".join(session.ask("Summarize.")))
    assert outputs[0] == outputs[1] and outputs[0]


def test_the_runner_holds_bf16_only_where_its_kernels_read_it_exactly(monkeypatch):
    from qspec_core.runner import kernel_table

    assert not kernel_table.holds_bf16("meta")
    monkeypatch.setenv("QSPEC_CPU_KERNELS", "0")
    assert not kernel_table.holds_bf16("cpu")
