"""A loaded model: weights, tokenizer and where they came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qspec_core.errors import QspecError
from qspec_core.model.transformer import Transformer, has_int8, set_target_weights
from qspec_core.registry.sources import (
    DEFAULT_MODEL,
    RegistryModel,
    ensure_registry_model,
    find_named_model,
    resolve_model,
)
from qspec_core.model.tokenizer import Tokenizer
from qspec_core.model.checkpoint import load_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast only with native bf16 dot products (AVX512-BF16 or AMX).

    Measured: with them, bf16 runs 4-5x fp32; on an AVX2-only EPYC a 2048^3 bf16 matmul ran at
    0.3 GFLOP/s against 87 for fp32 (docs/DESIGN.md).
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: str = "cpu") -> str:
    """The fast float of this machine: bf16 on GPUs, fp32 on every CPU.

    A bf16 CPU flag is not a speed-up here: on an AVX-512-BF16 Xeon qspec's bf16 path
    prefilled at 0.62-0.69x its fp32 path and decoded no faster (shared/facts.md), and the
    one-call C++ decode stack runs fp32 weights only. `--dtype bf16` stays available (and
    exact: the step kernels are batch-invariant in every dtype).
    """
    return "fp32" if device == "cpu" else "bf16"


@dataclass
class Runtime:
    model: Transformer
    tokenizer: Tokenizer
    folder: Path
    name: str

    @property
    def context_limit(self) -> int:
        return self.model.config.context_limit

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.model.config.eos_token_id))


DRAFT_SUFFIX = "-qspec-gptq"
DEFAULT_DRAFT = "SmolLM2-135M-Instruct" + DRAFT_SUFFIX
CALIB_TOKENS = 1024  # of the bundled GPL text, for the named models' GPTQ draft and INT8


def ensure_named_draft(model: RegistryModel, log=print) -> Path:
    """A named model converted with a GPTQ draft (and INT8 verifier weights), made once into
    the qspec cache the first time a mode needs it."""
    from qspec_core.convert.convert import INT8_METHOD, add_int8_weights, convert
    from qspec_core.bench.corpus import DATA
    from qspec_core.documents import read_document
    from qspec_core.registry.sources import models_dir

    target = models_dir() / (model.name + DRAFT_SUFFIX)
    meta = target / "qspec_draft.json"
    calib = DATA / "gpl-3.0.txt"
    calib_source = "qspec_core/data/gpl-3.0.txt"
    if meta.exists():
        int8 = json.loads(meta.read_text()).get("target_int8") or {}
        if int8.get("method") != INT8_METHOD:  # made before INT8 verification, or RTN INT8
            log(f"making {target.name}'s INT8 verifier weights (GPTQ, once)")
            ids = Tokenizer(target).encode(read_document(calib))[:CALIB_TOKENS]
            add_int8_weights(target, load_model(target, dtype=torch.float32), ids, calib_source)
        return target
    folder = ensure_registry_model(model, log)
    log(f"making {model.name}'s 4-bit draft and INT8 verifier weights (GPTQ, once) in {target}")
    weights = load_model(folder, dtype=torch.float32)
    ids = Tokenizer(folder).encode(read_document(calib))[:CALIB_TOKENS]
    convert(folder, target, weights, "gptq", None, ids, calib_source, force=True)
    return target


def ensure_default_draft(log=print) -> Path:
    return ensure_named_draft(DEFAULT_MODEL, log)


def load_runtime(
    spec: str | None,
    dtype: str = "auto",
    device: str = "cpu",
    log=print,
    need_draft: bool = False,
    target_weights: str = "full",
) -> Runtime:
    """Resolve `--model` and load it in `dtype` ("auto": `default_dtype`).

    `need_draft` with a named model (the default, qwen2.5-coder-0.5b) loads its converted
    folder with 4-bit draft weights, making it on first use. `target_weights="int8"` makes
    every non-draft path run on the INT8 weights of a converted folder (the verifier, and
    the baselines).
    """
    if dtype == "auto":
        dtype = default_dtype(device)
    named = DEFAULT_MODEL if spec in (None, "default") else find_named_model(spec)
    if named is not None and (need_draft or target_weights == "int8"):
        folder = ensure_named_draft(named, log)
        name = named.name
    else:
        folder = resolve_model(spec, log)
        name = spec or folder.name
    tokenizer = Tokenizer(folder)
    model = load_model(folder, dtype=DTYPES[dtype], device=device)
    if target_weights == "int8":
        if not has_int8(model):
            raise QspecError(
                f"{name} has no INT8 verifier weights: convert it with qspec convert (which "
                "writes them next to the 4-bit draft), then pass the converted folder"
            )
        set_target_weights(model, "int8")
    elif target_weights != "full":
        raise QspecError(f"--target-weights must be full or int8, not {target_weights!r}")
    return Runtime(model=model, tokenizer=tokenizer, folder=folder, name=name)
