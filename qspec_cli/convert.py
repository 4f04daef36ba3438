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
            help="rtn (round to nearest), gptq or awq (both calibrated on --calib); default rtn."
        ),
    ] = None,
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
    from qspec_core.convert.convert import convert as run_convert
    from qspec_core.convert.export import export_gptq_folder
    from qspec_core.convert.info import convert_steps, read_draft_meta, weight_error_summary
    from qspec_core.convert.recipes import RECIPES, get_recipe
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
    common.check_run_options("fp32", threads)
    calib_path = calib or BUNDLED_TEXTS / "gpl-3.0.txt"
    calib_text = common.read_text(calib_path)
    runtime = common.load(model, "fp32", threads)  # quantization math runs in fp32
    calib_ids = runtime.tokenizer.encode(calib_text)[:calib_tokens]
    draft_path = resolve_model(draft_from, common.log) if draft_from else None
    label = "import" if draft_path else f"{chosen.name if chosen else method} 4-bit"
    with common.step_progress(f"{label} + INT8 verifier", disable=as_json) as progress:
        on_layer = progress(convert_steps(runtime.model, draft_path is None, chosen))
        report = run_convert(
            runtime.folder,
            output,
            runtime.model,
            method,
            group_size,
            calib_ids,
            str(calib_path),
            force,
            on_layer=on_layer,
            draft_from=draft_path,
            recipe=chosen,
        )
    exported = None
    if export_gptq is not None:
        exported = str(export_gptq_folder(runtime.model, runtime.folder, export_gptq))
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
