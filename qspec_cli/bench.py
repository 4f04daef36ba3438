"""`qspec bench`: QuantSpec against autoregressive decoding and ablations, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from qspec_cli import common
from qspec_core.atomic_write import check_output_file
from qspec_core.config import check_kv_group_size


def bench(
    model: common.ModelOpt = None,
    context: Annotated[
        str,
        typer.Option(
            help="Context sizes, comma-separated, k = 1024: the cache length at the end "
            "(a prompt of real text, then --gen new tokens)."
        ),
    ] = "2k,8k",
    gen: Annotated[int, typer.Option(min=2, help="Tokens decoded per run.")] = 128,
    modes: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated modes (default: all but the opt-in ones): ar "
            "(full-precision baseline), target-ar (INT8 KV), quantspec, draft-w4 (ablation: "
            "4-bit weights, full KV), draft-kv4 (ablation: full weights, INT4 KV), ar-w8 "
            "(INT8 weights), quantspec-w8verify (INT8-weight verify), quantspec-g4 (the "
            "recipe before document drafts and --gamma auto: 4 drafts a round from the 4-bit "
            "path). Opt-in: target-ar-full and quantspec-full (the checkpoint's weights), "
            "quantspec-chain (quantspec without token trees)."
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per mode and context.")] = 3,
    gamma: common.GammaOpt = "auto",
    lookup: common.LookupOpt = True,
    temperature: common.TempOpt = 0.0,
    top_p: common.TopPOpt = 1.0,
    top_k: common.TopKOpt = 0,
    seed: common.SeedOpt = 0,
    group_size: common.GroupOpt = None,
    json_file: Annotated[
        Path | None,
        typer.Option("--json", help="Write every number to this JSON file ('-': stdout)."),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Draw tokens/s vs context and the stage shares to this PNG."),
    ] = None,
    warmup: Annotated[bool, typer.Option(help="One short unmeasured run per mode first.")] = True,
    target_weights: common.TargetWeightsOpt = "auto",
    dtype: common.DtypeOpt = "auto",
    threads: common.ThreadsOpt = None,
):
    """Benchmark QuantSpec against autoregressive decoding and two ablations, side by side.

    Modes run interleaved (A B C A B C ...) and report medians with min-max; the speedup over
    ar is taken pair-wise within each repeat. Ignores stop tokens: every run decodes --gen.
    """
    from qspec_cli.render import bench_tables
    from qspec_core.bench.runner import MODES as BENCH_MODES
    from qspec_core.bench.runner import (
        BenchConfig,
        needs_converted_model,
        needs_full_weights,
        parse_contexts,
        parse_modes,
        run_bench,
    )
    from qspec_core.registry.runtime import wanted_target_weights

    config = BenchConfig(
        contexts=parse_contexts(context),
        gen=gen,
        modes=parse_modes(modes),
        repeats=repeats,
        gamma=common.parse_gamma(gamma),
        params=common.sampling_params(temperature, top_p, top_k),
        seed=seed,
        group_size=group_size,
        warmup=warmup,
        lookup=lookup,
    )
    # gamma meets G only where a speculative mode verifies on the hierarchical cache (the
    # cache of a target KV view other than fp)
    gammas = [
        config.gamma_of(m)
        for m in config.modes
        if BENCH_MODES[m].speculative and BENCH_MODES[m].target.kv != "fp"
    ]
    fixed = [g for g in gammas if g != "auto"]
    spec_gamma = max(fixed) if fixed else (gammas[0] if gammas else None)
    check_kv_group_size(group_size, gamma=spec_gamma)
    common.check_run_options(dtype, threads, target_weights)
    if json_file is not None and str(json_file) != "-":
        check_output_file(json_file, "--json")  # not after minutes of benchmarking
    if plot is not None:
        from qspec_cli.plot import check_plotting

        check_plotting(plot)
        check_output_file(plot, "--plot")
    # (after every check: auto asks whether the CPU kernels run, which builds them, minutes)
    config.target_weights = wanted_target_weights(target_weights, "cpu")
    # a named model's converted folder (made once) only when a mode needs the draft or INT8
    need = needs_converted_model(config)
    # modes pick their weights; auto settles here (full where the model has no W8A8 weights)
    runtime = common.load(
        model, dtype, threads, need_draft=need,
        target_weights="auto" if need and target_weights == "auto" else "full",
        full_weights=needs_full_weights(config),
    )  # fmt: skip
    if target_weights == "auto":
        config.target_weights = runtime.target_weights
    common.check_group_size(group_size, runtime, spec_gamma)
    with common.err.status("bench") as status:
        report = run_bench(
            runtime,
            config,
            str(runtime.model.dtype).removeprefix("torch."),
            on_run=lambda label: status.update(f"bench · {label}"),
        )
    if json_file is not None:
        text = json.dumps(report, indent=1)
        if str(json_file) == "-":
            print(text)
        else:
            from qspec_core.atomic_write import write_atomic

            write_atomic(json_file, lambda f: f.write((text + "\n").encode()), force=True)
    if json_file is None or str(json_file) != "-":
        # a pipe or file gets the whole table rather than 80 columns of truncated cells
        out = common.out
        wide = out if out.is_terminal else Console(highlight=False, width=200)
        for table in bench_tables(report):
            wide.print(table)
            wide.print()
    if plot is not None:
        from qspec_cli.plot import plot_bench

        plot_bench(report, plot)
        common.err.print(Text(f"plot: {plot}"))
