"""`qspec summarize FILE|DIR... -o out.jsonl`: the batch's checks, progress bar and report."""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from rich.text import Text

from qspec_cli import common
from qspec_core.documents import display_name
from qspec_core.errors import QspecError


def run_batch(
    files: list[Path],
    output: Path,
    settings,
    workers: int,
    ray: str | None,
    snapshots: Path | None,
    threads: int | None,
    as_json: bool,
) -> None:
    """Everything checked before any model loads; then the documents left to do run on one
    process, `workers` local processes or Ray actors, each record appended as it comes.
    Nothing is created (the log, --snapshots) before a Ray cluster is joined."""
    from qspec_core.batch.inputs import expand_inputs
    from qspec_core.batch.records import RecordLog
    from qspec_core.batch.run import execute, plan

    if settings.mode == "ar" and snapshots is not None:
        raise QspecError("--snapshots hold the quantized cache: not with --mode ar")
    cpus = os.cpu_count() or 1
    if ray is None and workers > cpus:
        raise QspecError(f"--workers must be in 1..{cpus} (the CPUs here), not {workers}")
    for f in files:
        if str(f) == "-" or f.suffix == ".qspec":
            raise QspecError(
                f"{f}: a batch reads documents from files and folders (for snapshots, see "
                "--snapshots)"
            )
    paths = expand_inputs(files)
    if snapshots is not None and snapshots.exists() and not snapshots.is_dir():
        raise QspecError(f"{display_name(snapshots)}: --snapshots takes a folder")
    log = RecordLog(output)
    log.check()  # a file that is not a batch log: refused before anything starts
    executor = _ray_actors(settings, ray, workers, snapshots, threads) if ray else None
    try:
        if snapshots is not None:
            snapshots.mkdir(parents=True, exist_ok=True)
        with log:
            name = display_name(output)
            if log.repaired_bytes:
                common.warn(f"{name}: dropped a torn last record ({log.repaired_bytes} bytes)")
            todo, skipped = plan(paths, log, settings)
            if skipped:
                common.log(f"{len(skipped)} of {len(paths)} documents already done in {name}")
            if executor is None:
                executor = _executor(settings, todo, workers, snapshots, threads)
            with _progress_bar(len(todo), as_json) as on_record:
                failed = execute(todo, log, executor, on_record)
    finally:
        if executor is not None:
            executor.close()
    _report(paths, todo, skipped, failed, output, as_json)


def _ray_actors(settings, address, workers, snapshots, threads):
    """Ray joined (or started), then the actors: before the log or --snapshots exist, so a
    failed join leaves nothing behind. Ray's own messages go to a log file."""
    from qspec_core.batch.ray_pool import RayActors, import_ray

    import_ray()  # (a missing extra says so before the conversion step)
    ray_log = Path(tempfile.gettempdir()) / f"qspec-ray-{os.getpid()}.log"
    common.log(f"Ray: {address} (its messages go to {ray_log})")
    need_draft = settings.mode == "quantspec"
    total = threads or os.cpu_count() or 1
    threads = max(1, total // workers)
    actors = RayActors(settings, address, workers, threads, snapshots, log_path=ray_log)
    try:  # (the actors load the model when the first document comes: converted by then)
        common.prepare(settings.model, need_draft, settings.target_weights)
    except BaseException:
        actors.close()
        raise
    return actors


def _executor(settings, todo, workers, snapshots, threads):
    from qspec_core.batch.workers import InProcess, LocalWorkers

    need_draft = settings.mode == "quantspec"
    total = threads or os.cpu_count() or 1
    if workers > 1 and len(todo) > 1:
        common.prepare(settings.model, need_draft, settings.target_weights)
        return LocalWorkers(settings, min(workers, len(todo)), max(1, total // workers), snapshots)
    if not todo:
        return InProcess(None, settings, snapshots)  # (nothing to run: no model to load)
    runtime = common.load(
        settings.model, settings.dtype, threads, need_draft=need_draft,
        target_weights=settings.target_weights, full_weights=False,
    )  # fmt: skip
    common.check_group_size(settings.group_size, runtime, settings.gamma if need_draft else None)
    return InProcess(runtime, settings, snapshots)


@contextmanager
def _progress_bar(total: int, disable: bool):
    """Yields the on_record for `execute`: a transient bar over documents on stderr, with the
    elapsed time, an ETA and the tokens/s of the batch so far."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from qspec_cli.render import progress

    columns = (
        TextColumn("summaries"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"),
    )  # fmt: skip
    disable = disable or total == 0
    with progress(*columns, console=common.err, disable=disable) as bar:
        task = bar.add_task("summaries", total=total, rate="")
        start, tokens = time.perf_counter(), 0

        def on_record(record: dict) -> None:
            nonlocal tokens
            tokens += record.get("new_tokens", 0)
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=1, rate=f"{rate:,.1f} tok/s")

        yield on_record


def _report(paths, todo, skipped, failed, output, as_json) -> None:
    done = len(todo) - len(failed)
    output = display_name(output)
    failed = [{"path": r["path"], "error": common.printable(r["error"])} for r in failed]
    if as_json:
        summary = {
            "output": output,
            "documents": len(paths),
            "summarized": done,
            "skipped": len(skipped),
            "failed": failed,
        }
        print(json.dumps(summary, ensure_ascii=False))
    else:
        common.out.print(
            Text(
                f"{output}: {done} summarized, {len(skipped)} already done, "
                f"{len(failed)} failed, of {len(paths)} documents"
            )
        )
    if failed:
        for record in failed:
            path, why = record["path"], record["error"]
            common.err.print(Text(f"  {why}" if why.startswith(path) else f"  {path}: {why}"))
        raise QspecError(
            f"{len(failed)} of {len(paths)} documents failed (listed above; a rerun retries them)"
        )
