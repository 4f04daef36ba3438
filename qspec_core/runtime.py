"""A loaded model: weights, tokenizer and where they came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qspec_core.model import Transformer
from qspec_core.models import resolve_model
from qspec_core.tokenizer import Tokenizer
from qspec_core.weights import load_model

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
    """The fast float of this machine: bf16 on GPUs and bf16-capable CPUs, else fp32."""
    if device != "cpu" or cpu_has_fast_bf16():
        return "bf16"
    return "fp32"


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


DEFAULT_DRAFT = "SmolLM2-135M-Instruct-qspec-gptq"


def ensure_default_draft(log=print) -> Path:
    """The default model converted with a GPTQ draft, made once into the qspec cache."""
    from qspec_core.convert import convert
    from qspec_core.documents import read_document
    from qspec_core.models import models_dir

    target = models_dir() / DEFAULT_DRAFT
    if (target / "qspec_draft.json").exists():
        return target
    folder = resolve_model(None, log)
    log(f"making the default model's 4-bit draft (GPTQ, once) in {target}")
    model = load_model(folder, dtype=torch.float32)
    calib = Path(__file__).resolve().parent / "data" / "gpl-3.0.txt"
    ids = Tokenizer(folder).encode(read_document(calib))[:1024]
    convert(folder, target, model, "gptq", None, ids, "qspec_core/data/gpl-3.0.txt", force=True)
    return target


def load_runtime(
    spec: str | None,
    dtype: str = "auto",
    device: str = "cpu",
    log=print,
    need_draft: bool = False,
) -> Runtime:
    """Resolve `--model` and load it in `dtype` ("auto": `default_dtype`).

    `need_draft` with the default model loads (making it on first use) its converted
    folder with 4-bit draft weights.
    """
    if dtype == "auto":
        dtype = default_dtype(device)
    if spec is None and need_draft:
        folder = ensure_default_draft(log)
        name = "SmolLM2-135M-Instruct"
    else:
        folder = resolve_model(spec, log)
        name = spec or folder.name
    tokenizer = Tokenizer(folder)
    model = load_model(folder, dtype=DTYPES[dtype], device=device)
    return Runtime(model=model, tokenizer=tokenizer, folder=folder, name=name)
