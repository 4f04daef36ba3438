"""What every command shares: the consoles, the option types, and the checks and loading that
run before a command's one library call. Commands import this module, never each other."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from kernels import MAX_DRAFTS
from qspec_core.config import check_gamma, check_kv_group_size
from qspec_core.documents import is_stdin, printable, read_document
from qspec_core.engine.sampling import MIN_TEMPERATURE, SamplingParams
from qspec_core.engine.session import MODES, ChatSession
from qspec_core.errors import QspecError

# emoji=False: a file named `a:cat:b.txt` keeps its name. User strings (paths, model names,
# messages) are printed as `Text`, never as markup: `x[/red].txt` would raise MarkupError,
# and `rich.markup.escape` renders a trailing backslash doubled at the end of a line.
out = Console(highlight=False, emoji=False)
err = Console(stderr=True, highlight=False, emoji=False)


def log(message: str) -> None:
    err.print(Text(printable(message), style="dim"), soft_wrap=True)  # paths stay copy-pastable


def warn(message: str) -> None:
    err.print(Text(printable(message), style="yellow"))


def print_error(message: str) -> None:
    """`error: MESSAGE` as exactly one line: a message may hold newlines (a library's error,
    a file name) and must not be wrapped at the terminal's width either."""
    line = " ".join(part.strip() for part in printable(str(message)).splitlines() if part.strip())
    err.print(Text.assemble(("error:", "red"), " ", line), soft_wrap=True)


# ----------------------------------------------------------------------------- option types

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model folder (HF safetensors), .gguf file, hub id, or a named model "
        "(qwen2.5-coder-0.5b: 32k context, opt-in download). "
        "Default: SmolLM2-135M-Instruct, converted once into $QSPEC_HOME.",
    ),
]
ModeOpt = Annotated[
    str,
    typer.Option(
        help="quantspec: self-speculative (4-bit draft, INT8-KV verify; needs a converted model, "
        "the default one is converted on first use); target-ar: autoregressive on the "
        "target path (the distribution quantspec reproduces); ar: the target weights over "
        "full-precision KV (the baseline)."
    ),
]
GammaOpt = Annotated[
    str,
    typer.Option(
        help=f"Draft tokens per round (1-{MAX_DRAFTS}), or 'auto': each round picks its drafts "
        "(4-bit, from the document, or none) and their number by the step costs and acceptance "
        "measured while decoding, for the most tokens per second."
    ),
]
LookupOpt = Annotated[
    bool,
    typer.Option(
        help="quantspec: also draft from the document and the conversation; when the last "
        "tokens occurred earlier, propose what followed them there (a lookup instead of draft "
        "steps; the output is the same). --no-lookup: every draft from the 4-bit path."
    ),
]
GroupOpt = Annotated[
    int | None,
    typer.Option(
        help="KV quantization group G: even, divides head_dim, above --gamma "
        "(default: the model's head_dim)."
    ),
]
MaxNewOpt = Annotated[int, typer.Option(min=1, help="Most tokens to generate per answer.")]
# temperature and top-p are checked by SamplingParams (finite, in range), one message for all
TempOpt = Annotated[
    float,
    typer.Option(help=f"Sampling temperature: 0 is greedy, else at least {MIN_TEMPERATURE}."),
]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")]
TopKOpt = Annotated[int, typer.Option(min=0, help="Sample from the k likeliest tokens; 0: all.")]
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
SeedOpt = Annotated[
    int,
    typer.Option(
        min=0,
        max=SEED_MAX,
        help="Seed of the sampling: each token's randomness is keyed by (seed, position), so "
        "runs reproduce whatever --gamma picks, and quantspec gives target-ar's text.",
    ),
]
TruncOpt = Annotated[
    bool,
    typer.Option("--truncate", help="Cut the end of a document longer than the model's context."),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        help="Weights/activations dtype: fp32 (the CPU default; a bf16 checkpoint's linears "
        "stay bf16 where the kernels read them exactly), bf16 (the GPU default), fp16."
    ),
]
ThreadsOpt = Annotated[int | None, typer.Option(min=1, help="CPU threads (default: all cores).")]
TargetWeightsOpt = Annotated[
    str,
    typer.Option(
        help="Weights of the target (verify) path, whose output the run follows: auto (w8a8 on "
        "a CPU when the model has INT8 weights, else full; a snapshot's own), full (the "
        "checkpoint's), int8 (per-channel INT8, W8A16) or w8a8 (the same INT8 weights with "
        "activations rounded to int8 per 64 inputs: integer dot products, the fast CPU path). "
        "int8 and w8a8 need a folder from qspec convert (the default model's is made on "
        "first use)."
    ),
]

# ----------------------------------------------------------------------------- checks


def parse_gamma(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        gamma = int(value)
    except ValueError:
        raise QspecError(f"--gamma must be a number or 'auto', not {value!r}") from None
    check_gamma(gamma)
    return gamma


def sampling_params(temperature: float, top_p: float, top_k: int) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    except ValueError as e:
        raise QspecError(str(e)) from None


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise QspecError(f"mode {mode!r} is not available (have: {', '.join(MODES)})")


def check_session_options(
    mode: str,
    gamma: str,
    group_size: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    dtype: str,
    threads: int | None,
    target_weights: str,
) -> tuple[SamplingParams, int | str]:
    """Every option of a session command (chat, summarize), checked before any input is read
    or any model loads: returns (sampling parameters, gamma)."""
    params = sampling_params(temperature, top_p, top_k)
    check_mode(mode)
    drafts = parse_gamma(gamma)
    check_kv_group_size(group_size, gamma=drafts if mode == "quantspec" else None)
    check_run_options(dtype, threads, target_weights)
    return params, drafts


def check_run_options(dtype: str, threads: int | None, target_weights: str = "full") -> None:
    """Options `load` uses, checked before anything is read or loaded; then the qspec folder
    (QSPEC_HOME), before the CPU kernels would build in it."""
    from kernels.cpu.build import kernels_enabled
    from qspec_core.paths import check_home
    from qspec_core.registry.runtime import DTYPES, TARGET_WEIGHTS
    from qspec_core.runner import products_choice
    from qspec_core.runner.prefill_choice import override

    if dtype != "auto" and dtype not in DTYPES:
        raise QspecError(f"--dtype must be auto or one of {', '.join(DTYPES)}, not {dtype!r}")
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cpus:
        # more threads than CPUs only slows a CPU-bound step; far more crashes the kernels
        raise QspecError(f"--threads must be in 1..{cpus} (the CPUs here), not {threads}")
    if target_weights not in TARGET_WEIGHTS:
        raise QspecError(
            f"--target-weights must be one of {', '.join(TARGET_WEIGHTS)}, not {target_weights!r}"
        )
    kernels_enabled()  # (QSPEC_CPU_KERNELS, likewise: 0 or 1)
    override()  # (QSPEC_INT8_PREFILL: a bad value is an error now, not at the first prefill)
    products_choice.override()  # (QSPEC_PREFILL_PRODUCTS, likewise)
    check_home()


def check_group_size(group_size: int | None, runtime, gamma: int | str | None = None) -> None:
    """The part of --group-size (and --gamma) that depends on the model, checked as soon as it
    is loaded: before any prefill."""
    check_kv_group_size(group_size, runtime.model.config.head_dim, gamma)


# ----------------------------------------------------------------------------- input and model


def read_text(path: Path) -> str:
    """A document's text, read once: a FIFO or a pipe (`-`) cannot be read a second time."""
    if is_stdin(path) and sys.stdin.isatty():
        log("reading the document from standard input: end it with Ctrl-D")
    return read_document(path)


def read_input(file: Path) -> tuple[Path | None, str | None]:
    """FILE of summarize: (snapshot, None) for a `*.qspec`, else (None, the document's text).
    Either way checked before any model loads."""
    if file.suffix == ".qspec":
        from qspec_core.store.snapshot import read_manifest

        read_manifest(file)  # not a snapshot, or a damaged one: say so before loading
        return file, None
    return None, read_text(file)


def load(
    model: str | None,
    dtype: str,
    threads: int | None,
    quiet: bool = False,
    need_draft: bool = False,
    target_weights: str = "full",
    full_weights: bool = True,
):
    """The runtime of `model` (`prepare_and_load`). `full_weights=False`: a command whose paths
    are all on the target weights and the draft does not read full weights it will not run
    (`load_runtime`)."""
    import torch

    from qspec_core.registry.runtime import prepare_and_load

    # (every command runs check_run_options before anything slow, so not again here)
    if threads:
        torch.set_num_threads(threads)
    say = (lambda msg: None) if quiet else log
    # the explicit conversion step (loading never converts): a named model's 4-bit draft and
    # INT8 weights are made once, here, saying so, with a progress bar
    with step_progress("GPTQ 4-bit draft + INT8 verifier", disable=quiet) as progress:
        return prepare_and_load(
            model,
            progress,
            dtype=dtype,
            log=say,
            need_draft=need_draft,
            target_weights=target_weights,
            full_weights=full_weights,
        )


def prepare(model: str | None, need_draft: bool, target_weights: str) -> None:
    """The conversion step alone (what `load` runs first), for workers that load the model
    themselves: they then only load, never convert at once."""
    from qspec_core.registry.prepare import prepare_for
    from qspec_core.registry.runtime import wanted_target_weights

    weights = wanted_target_weights(target_weights, "cpu")
    with step_progress("GPTQ 4-bit draft + INT8 verifier") as progress:
        prepare_for(model, need_draft, weights, log, progress)


@contextmanager
def step_progress(description: str, disable: bool = False):
    """A transient bar on stderr: yields `start(total)`, which adds the task and returns the
    callback to call after each step (e.g. `convert`'s `on_layer`)."""
    from rich import progress as rp

    from qspec_cli.render import progress

    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
               rp.TimeElapsedColumn(), rp.TextColumn("eta"), rp.TimeRemainingColumn())  # fmt: skip
    with progress(*columns, console=err, disable=disable) as bar:

        def start(total: int):
            task = bar.add_task(description, total=total)
            return lambda _step=None: bar.advance(task)

        yield start


def load_session(model, dtype, threads, target_weights, snapshot, text, **kwargs) -> ChatSession:
    """Load the model a session's mode needs (checking --group-size against it), then open the
    session over the snapshot or the text; `kwargs` are `ChatSession`'s (mode, gamma, ...)."""
    mode, gamma = kwargs["mode"], kwargs.get("gamma")
    need_draft = mode == "quantspec"
    adopted = target_weights == "auto" and snapshot is not None
    if adopted:
        from qspec_core.store.snapshot import read_manifest

        # a snapshot holds KV its target weights computed: auto continues on those
        target_weights = read_manifest(snapshot).get("target_weights", "full")
    try:
        runtime = load(
            model,
            dtype,
            threads,
            need_draft=need_draft,
            target_weights=target_weights,
            full_weights=False,
        )  # fmt: skip (every mode runs the target weights)
    except QspecError as e:
        if not adopted:
            raise
        raise QspecError(
            f"{snapshot.name} was made with --target-weights {target_weights}, which this run "
            f"cannot use ({e}); prefill the document again"
        ) from None
    check_group_size(kwargs.get("group_size"), runtime, gamma if need_draft else None)
    return open_session(snapshot, text, runtime, **kwargs)


def open_session(snapshot: Path | None, text: str | None, runtime, **kwargs) -> ChatSession:
    """A session over a snapshot (`*.qspec`, no re-prefill) or over a document's text."""
    if snapshot is not None:
        from qspec_core.store.snapshot import load_snapshot

        snap = load_snapshot(
            snapshot,
            runtime.folder,
            runtime.model,
            runtime.context_limit,
            kwargs.get("group_size"),
            runtime.target_weights,
        )
        # the snapshot's document is what was prefilled (cut already if it was too long):
        # cutting it again here would change its tokens
        session = ChatSession(runtime, snap.document, **{**kwargs, "truncate": False})
        session.adopt_cache(snap.cache, snap.token_ids)
        return session
    return ChatSession(runtime, text, **kwargs)
