"""`qspec convert --export-gptq`: the draft as a standard GPTQ checkpoint folder that other
tools load whole (weights, config and the tokenizer files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qspec_core.convert.convert import export_gptq
from qspec_core.model.transformer import Transformer

# what a loader needs next to the weights to run the checkpoint as is
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def export_gptq_folder(model: Transformer, source: Path, out: Path) -> Path:
    """Write `model`'s draft (loaded from `source`) as a GPTQ checkpoint in `out`, with the
    source's config and tokenizer files; returns the folder written."""
    config = json.loads((source / "config.json").read_text())
    exported = export_gptq(model, config, out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, exported / name)
    return exported
