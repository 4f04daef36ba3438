"""`qspec info`: a snapshot's manifest and sizes, and whether it matches a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from qspec_cli import common


def info(
    snapshot: Annotated[Path, typer.Argument(help="A snapshot file (*.qspec).")],
    model: common.ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Show a snapshot's manifest and sizes, and whether it matches a model (--model, or the
    default model)."""
    from qspec_core.registry.sources import resolve_model
    from qspec_core.store.snapshot import model_fingerprint, tokenizer_fingerprint, verify_snapshot

    manifest = verify_snapshot(snapshot)  # every tensor's checksum: a flipped bit is refused
    folder = resolve_model(model, common.log)
    checks = {
        "model": manifest["model_fingerprint"] == model_fingerprint(folder),
        "tokenizer": manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(folder),
    }
    size = snapshot.stat().st_size
    if as_json:
        print(
            json.dumps(
                {"bytes": size, "matches": checks, "checked_against": str(folder), **manifest}
            )
        )
        return
    from rich.table import Table

    table = Table(title=Text(str(snapshot)), title_justify="left", show_header=False)
    q = manifest["quantization"]
    rows = [
        ("model", manifest["model"]),
        ("created", f"{manifest['created']} with qspec {manifest['qspec_version']}"),
        ("format", f"{manifest['format']} v{manifest['format_version']}"),
        (
            "tokens",
            f"{manifest['tokens']:,} ({manifest['n_quant']:,} quantized, "
            f"{manifest['fp_len']:,} full precision)",
        ),
        (
            "quantization",
            f"INT4 upper + INT4 lower planes, G = {q['group_size']}, K "
            f"{q['key_grouping']}, V {q['value_grouping']}",
        ),
        # the weights that computed its KV: a chat on it must use the same (auto does)
        ("target weights", manifest.get("target_weights", "full")),
        ("size", f"{size / 2**20:,.2f} MiB"),
        ("document sha256", manifest["document_sha256"][:16] + "…"),
        (
            "matches " + str(folder.name),
            ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in checks.items()),
        ),
    ]
    for key, value in rows:
        table.add_row(Text(key), Text(str(value)))  # manifest values and names are not markup
    common.out.print(table)
