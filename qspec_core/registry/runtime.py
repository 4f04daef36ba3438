"""A loaded model: weights, the runner that runs them, tokenizer and where they came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.cpu import build as cpu_kernels
from qspec_core.convert.folder import int8_modules, load_draft
from qspec_core.errors import QspecError
from qspec_core.model.checkpoint import load_model
from qspec_core.model.tokenizer import Tokenizer
from qspec_core.model.transformer import Transformer, has_int8
from qspec_core.precision import FP, INT8_WEIGHTS, TARGET, Precision
from qspec_core.registry.prepare import (
    Progress,
    conversion_needed,
    converted_folder,
    converted_model_for,
    prepare_for,
)
from qspec_core.registry.sources import resolve_model
from qspec_core.runner import Runner, build_runner
from qspec_core.runner.kernel_table import holds_bf16
from qspec_core.timing import StepCosts

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
    """A loaded model and its runner. Forwards go through `runner` (`qspec_core/runner/`);
    `model` is the math (config, weights, twins), and the PyTorch reference when called
    itself (calibration)."""

    model: Transformer
    runner: Runner  # built for the model where it is (`build_runner`); `to` builds it again
    tokenizer: Tokenizer
    folder: Path
    name: str
    target_weights: str = "full"  # the weights of every non-draft path: full, int8 or w8a8
    # step timings its decodes measured, for the next decode's `--gamma auto` to start from
    costs: StepCosts = field(default_factory=StepCosts)

    def to(self, device=None, dtype=None) -> Runtime:
        """Move or cast the model (`nn.Module.to`), then build the runner again for where it
        now is: what the old one built points at the old tensors, and the device may want
        another kind of runner."""
        if "full" not in self.model.weight_sets:
            raise QspecError(f"{self.name} was loaded without its full weights: load it again")
        self.runner.close()
        self.model.to(device=device, dtype=dtype)
        self.runner = build_runner(self.model)
        self.costs = StepCosts()  # (timings of the old device or dtype mislead the planner)
        return self

    @property
    def target(self) -> Precision:
        """The verify's path: the target weights over the INT8 KV view."""
        return TARGET.with_weights(self.target_weights)

    @property
    def baseline(self) -> Precision:
        """Plain autoregressive decoding: the target weights over full-precision KV."""
        return FP.with_weights(self.target_weights)

    @property
    def context_limit(self) -> int:
        return self.model.config.context_limit

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.model.config.eos_token_id))


def load_runtime(
    spec: str | None,
    dtype: str = "auto",
    device: str = "cpu",
    log=print,
    need_draft: bool = False,
    target_weights: str = "full",
    full_weights: bool = True,
) -> Runtime:
    """Resolve `--model` and load it in `dtype` ("auto": `default_dtype`). Never converts:
    a named model's converted folder (4-bit draft, INT8 weights) is made by an explicit step
    (`registry.prepare.prepare_named`), and its absence is an error that says so.

    `need_draft` with a named model (the default, qwen2.5-coder-0.5b) loads its converted
    folder. `target_weights="int8"` makes every non-draft path of the sessions and bench that
    use this runtime run on the INT8 weights of a converted folder (`Runtime.target`), "w8a8"
    the same with int8 activations; "auto" picks (`wanted_target_weights`, then
    `Runtime.target_weights` says what it got).

    `full_weights=False`: a run whose every path is on the INT8 weights or the 4-bit draft
    (summarize, chat, prefill on a converted folder) does not read the linears' full weights
    where the folder has INT8 ones: it holds what it reads (the model then has no "full"
    weight set, `Transformer.check_path`).
    """
    if target_weights not in TARGET_WEIGHTS:
        raise QspecError(
            f"--target-weights must be one of {', '.join(TARGET_WEIGHTS)}, not {target_weights!r}"
        )
    if dtype == "auto":
        dtype = default_dtype(device)
    wanted = wanted_target_weights(target_weights, device)
    named = converted_model_for(spec, need_draft, wanted)
    if named is not None:
        why = conversion_needed(named)
        if why is not None:
            raise QspecError(
                f"{named.name} is not converted yet ({why}): `registry.prepare.prepare_named` "
                "makes it (every qspec command that needs it does so first, saying so)"
            )
        folder = converted_folder(named)
        name = named.name
    else:
        folder = resolve_model(spec, log)
        name = spec or folder.name
    tokenizer = Tokenizer(folder)
    skip = () if full_weights or wanted not in INT8_WEIGHTS else int8_modules(folder)
    held = DTYPES[dtype] == torch.float32 and holds_bf16(device)  # (bf16 weights: 2 bytes)
    model = load_model(folder, DTYPES[dtype], device, skip, bf16_held=held)
    # a converted folder carries its 4-bit draft and INT8 weights; a run on the full weights
    # alone (not bench's, which runs every weight set) holds the draft's share of them only
    lean = not full_weights and wanted == "full"
    load_draft(folder, model, with_draft=need_draft or not lean, with_int8=not lean)
    if target_weights in INT8_WEIGHTS and not has_int8(model):
        raise QspecError(
            f"{name} has no INT8 verifier weights: convert it with qspec convert (which "
            "writes them next to the 4-bit draft), then pass the converted folder"
        )
    if target_weights == "w8a8" and "w8a8" not in model.weight_sets:
        raise QspecError(
            f"--target-weights w8a8 needs every linear layer's inputs in whole 64-input chunks; "
            f"{name} has others: use int8 or full"
        )
    if target_weights == "auto":
        if wanted == "w8a8" and "w8a8" not in model.weight_sets and skip:
            log(f"target weights: int8 ({name} has no INT8 weights that W8A8 can run)")
            wanted = "int8"  # (the full weights were not read)
        elif wanted == "w8a8" and "w8a8" not in model.weight_sets:
            log(f"target weights: full ({name} has no INT8 weights that W8A8 can run)")
            wanted = "full"
        target_weights = wanted
    # the runner last: after every twin is attached, from the tensors the model holds now
    return Runtime(model, build_runner(model), tokenizer, folder, name, target_weights)


TARGET_WEIGHTS = ("auto", "full", *INT8_WEIGHTS)  # --target-weights


def wanted_target_weights(target_weights: str, device: str) -> str:
    """What `--target-weights auto` asks for: W8A8 on a CPU where qspec's C++ kernels run
    (measured faster than the full model's target path at the same exactness, perplexity
    within 1% of the full model's: docs/PERF.md; without the kernels it would be slower), the
    full weights elsewhere. Any other value is itself."""
    if target_weights != "auto":
        return target_weights
    return "w8a8" if str(device).startswith("cpu") and cpu_kernels.available() else "full"


def prepare_and_load(spec: str | None, progress: Progress | None = None, **options) -> Runtime:
    """The explicit conversion step (`prepare_for`: a named model's converted folder, made
    once, saying so through `log`), then `load_runtime(spec, **options)`. What the CLI and
    scripts call."""
    need_draft, weights = options.get("need_draft", False), options.get("target_weights", "full")
    weights = wanted_target_weights(weights, options.get("device", "cpu"))
    prepare_for(spec, need_draft, weights, options.get("log", print), progress)
    return load_runtime(spec, **options)
