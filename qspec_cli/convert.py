"""`qspec convert`: a converted model folder (full-precision target plus 4-bit draft)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from qspec_cli import common
from qspec_core.errors import QspecError
from qspec_core.paths import BUNDLED_TEXTS


def convert(
    model: Annotated[
        str | None,
        typer.Argument(help="Source model (folder, .gguf or hub id); default: the default model."),
    ] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write.")] = Path(
        "qspec-draft"
    ),
    method: Annotated[
        str | None,
        typer.Option(
            help="The 4-bit draft's rounding: rtn (to nearest: no cost beyond reading each "
            "weight), gptq (error feedback through each layer's calibration Hessian: an "
            "O(K^3) inverse and an O(N K^2) sweep per linear) or awq (a scale search on each "
            "layer's calibration inputs); default rtn. Every method runs the calibration text "
            "through the model once, one layer at a time (peak memory: about one layer).",
        ),
    ] = None,
    int8: Annotated[
        str,
        typer.Option(
            "--int8",
            help="The INT8 verifier weights' rounding: gptq (default; its perplexity cost "
            "+0.35% against +1.03% to nearest on the default model, and ~80% of an RTN "
            "conversion's time) or rtn (to nearest: with --method rtn nothing is calibrated).",
        ),
    ] = "gptq",
    recipe: Annotated[
        str | None,
        typer.Option(
            help="A named draft recipe: method, group size, which layers are 4-bit (the rest "
            "draft on the INT8 weights the verifier holds anyway), GPTQ damping. "
            "`qspec convert --recipes` lists them; the default model uses 'gptq'. Not with "
            "--method or --group-size.",
        ),
    ] = None,
    list_recipes: Annotated[
        bool, typer.Option("--recipes", help="List the named recipes and exit.")
    ] = False,
    group_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Quantization group along in_features (even); default 128, or 64 where 128 "
            "does not divide every layer. A group that does not divide a layer's inputs leaves "
            "a short last group, as GPTQ makes it (such layers draft through W4A16, not the "
            "faster W4A8 kernel, on a CPU).",
        ),
    ] = None,
    calib: Annotated[
        Path | None,
        typer.Option(help="Calibration text (default: the bundled GPL-3.0 text; '-': stdin)."),
    ] = None,
    calib_tokens: Annotated[int, typer.Option(min=64, help="Calibration tokens to use.")] = 1024,
    draft_from: Annotated[
        str | None,
        typer.Option(
            help="Import the draft from a GPTQ or AWQ checkpoint (folder or hub id) instead."
        ),
    ] = None,
    export_gptq: Annotated[
        Path | None, typer.Option(help="Also write the draft as a standard GPTQ checkpoint folder.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    threads: common.ThreadsOpt = None,
):
    """Make a converted model: full-precision target weights plus 4-bit draft weights.

    Every linear layer (lm_head included) gets a 4-bit twin. The report gives each layer's
    relative weight error and, on the calibration text, the draft's top-1 agreement and KL
    against the target. Use the output with --model everywhere.
    """
    import torch

    from qspec_core.convert.convert import convert as run_convert
    from qspec_core.convert.export import export_gptq_folder
    from qspec_core.convert.info import convert_steps, read_draft_meta, weight_error_summary
    from qspec_core.convert.recipes import RECIPES, get_recipe
    from qspec_core.convert.stream import convert_streaming
    from qspec_core.model.checkpoint import load_model
    from qspec_core.model.tokenizer import Tokenizer
    from qspec_core.registry.sources import resolve_model

    if list_recipes:
        if as_json:
            print(json.dumps({name: r.to_dict() for name, r in RECIPES.items()}))
        else:
            for name, r in RECIPES.items():
                common.out.print(Text(f"{name:12s} {r.about}"))
        return
    chosen = None
    if recipe is not None:
        if method is not None or group_size is not None or draft_from is not None:
            raise QspecError(
                "--recipe sets the method and group size and makes the draft: drop --method, "
                "--group-size and --draft-from, or drop --recipe"
            )
        chosen = get_recipe(recipe)
    method = method or "rtn"
    if draft_from is None and method not in ("rtn", "gptq", "awq"):
        raise QspecError(f"--method {method!r} is not available (have: rtn, gptq, awq)")
    if int8 not in ("gptq", "rtn"):
        raise QspecError(f"--int8 must be gptq or rtn, not {int8!r}")
    if int8 == "rtn" and (draft_from is not None or export_gptq is not None):
        raise QspecError("--int8 rtn is not available with --draft-from or --export-gptq")
    if group_size is not None and group_size % 2:
        raise QspecError(f"--group-size must be even, not {group_size}")
    common.check_run_options("fp32", threads)
    check_output(output, force)
    if export_gptq is not None:
        check_output(export_gptq, True)
    calib_path = calib or BUNDLED_TEXTS / "gpl-3.0.txt"
    calib_text = common.read_text(calib_path)
    if threads:
        torch.set_num_threads(threads)
    folder = resolve_model(model, common.log)
    calib_ids = Tokenizer(folder).encode(calib_text)[:calib_tokens]
    draft_path = resolve_model(draft_from, common.log) if draft_from else None
    label = "import" if draft_path else f"{chosen.name if chosen else method} 4-bit"
    whole = None  # the whole model in fp32: an import, or a GPTQ export, reads it
    with common.step_progress(f"{label} + INT8 verifier", disable=as_json) as progress:
        if draft_path is None and export_gptq is None:  # (layer by layer: convert/stream.py)
            report = convert_streaming(
                folder, output, method, group_size, calib_ids, str(calib_path), force,
                recipe=chosen, progress=progress, int8_method=int8,
            )  # fmt: skip
        else:
            whole = load_model(folder, dtype=torch.float32)  # quantization math runs in fp32
            on_layer = progress(convert_steps(whole, draft_path is None, chosen))
            report = run_convert(folder, output, whole, method, group_size, calib_ids,
                                 str(calib_path), force, on_layer=on_layer, draft_from=draft_path,
                                 recipe=chosen)  # fmt: skip
    exported = None
    if export_gptq is not None:
        exported = str(export_gptq_folder(whole, folder, export_gptq))
    meta = read_draft_meta(output)
    if as_json:
        print(json.dumps({"output": str(output), "exported_gptq": exported, **meta}))
        return
    mean, worst, worst_error = weight_error_summary(report)
    common.out.print(
        Text(
            f"wrote {output} · {meta['method']} · group {meta['group_size']} · "
            f"{len(meta['modules'])} layers in 4 bits"
        )
    )
    common.out.print(
        Text(f"relative weight error: mean {mean:.4f}, worst {worst_error:.4f} ({worst})")
    )
    if report.tokens:
        common.out.print(
            f"draft vs target on {min(report.tokens, 1024)} calibration tokens: top-1 "
            f"agreement {report.top1_agreement:.2%}, KL {report.kl:.4f} nats"
        )
    if exported:
        common.out.print(Text(f"GPTQ checkpoint: {exported}"))


def check_output(folder: Path, force: bool) -> None:
    """Refuse, before any work, an output folder qspec could not write: one that exists and is
    not empty (without --force), a file, or one below a file or an unwritable folder."""
    import os

    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not force:
        raise QspecError(f"{folder} exists and is not empty; pass --force to replace it")
    if folder.exists() and not folder.is_dir():
        raise QspecError(f"{folder} is a file, not a folder")
    parent = folder.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise QspecError(f"cannot write {folder}: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK) or not _can_create_in(parent):
        raise QspecError(f"cannot write {folder}: {parent} is not writable")


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in `folder` (/proc and read-only mounts say no even to root,
    whom `os.access` always answers yes)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False
