import os

# Triton runs on CPU only in its interpreter, which must be chosen before any kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "qspec_core" / "data"
# The shape every tiny test model shares (hf_tiny, tiny_model_dir, test_config); each adds its
# vocabulary, context and KV heads.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def run_qspec(*args, cwd=None, env=None, input=None, timeout=600):
    """`qspec ARGS` in a fresh process (`python -m qspec_cli.app`), output captured as text."""
    cmd = [sys.executable, "-m", "qspec_cli.app", *map(str, args)]
    return subprocess.run(
        cmd, input=input, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def fresh_machine_choice(module, monkeypatch, tmp_path):
    """For a fixture to `yield from`: an empty qspec cache, no override of `module`'s measured
    choice (its ENV), and no choice remembered by this process (`machine_choice` users)."""
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    monkeypatch.delenv(module.ENV, raising=False)
    module._measured_choice.cache_clear()
    yield tmp_path
    module._measured_choice.cache_clear()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model, converted once per machine into the user's qspec cache."""
    from qspec_core.registry.sources import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def default_converted(default_model_dir) -> Path:
    """The default model's converted folder (4-bit draft, INT8 weights), made once per machine
    by the explicit step every CLI command takes first (loading never converts)."""
    from qspec_core.registry.prepare import prepare_named
    from qspec_core.registry.sources import DEFAULT_MODEL

    return prepare_named(DEFAULT_MODEL, log=lambda m: None)


@pytest.fixture(scope="session")
def real_runtime(default_model_dir):
    """The default model in fp32: the bf16 weights upcast, fast on every CPU, exact vs HF."""
    from qspec_core.registry.runtime import load_runtime

    return load_runtime(str(default_model_dir), dtype="fp32", log=lambda m: None)


def tiny_converted(tmp_path_factory, default_model_dir, config, name: str) -> Path:
    """A random model of the transformers `config` (seed 0, the default model's tokenizer and
    chat template), converted with an RTN 4-bit draft of group 32: its folder."""
    import transformers

    from qspec_core.convert.convert import convert
    from qspec_core.model.checkpoint import load_model

    folder = tmp_path_factory.mktemp(f"tiny-{name}-hf")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / file, folder / file)
    converted = tmp_path_factory.mktemp("tiny") / name
    convert(folder, converted, load_model(folder, dtype=torch.float32), "rtn", 32)
    return converted


# the vocabulary and token ids of the default model's tokenizer (the tiny models' own)
TINY_VOCAB = dict(vocab_size=49152, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the real tokenizer and an RTN 4-bit draft (fast CLI and
    session tests in every mode)."""
    import transformers

    config = transformers.LlamaConfig(
        **TINY_SHAPE | dict(intermediate_size=128),  # a wider MLP than hf_tiny's
        num_key_value_heads=2,
        max_position_embeddings=512,
        **TINY_VOCAB,
    )
    return tiny_converted(tmp_path_factory, default_model_dir, config, "llama")


@pytest.fixture
def spy(monkeypatch):
    """`spy(module, name, calls=None)`: module.name still runs, and each call appends `name` to
    `calls` (a new list unless given, to share one between several spies), which it returns."""

    def install(module, name: str, calls: list | None = None) -> list:
        calls = [] if calls is None else calls
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))
        return calls

    return install


@pytest.fixture
def read_only_tmp(tmp_path, monkeypatch) -> Path:
    """tmp_path as a read-only mount would be: every create under it fails with EROFS (root
    writes any plain folder, so the refusal is simulated in `atomic_write`'s os.open)."""
    import errno

    from qspec_core import atomic_write

    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(tmp_path)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(atomic_write.os, "open", read_only)
    return tmp_path
