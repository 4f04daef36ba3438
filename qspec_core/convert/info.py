"""A conversion before and after: the progress steps `convert` reports, and what a converted
folder's `qspec_draft.json` says about its draft."""

from __future__ import annotations

import json
from pathlib import Path

from qspec_core.convert.convert import DraftReport
from qspec_core.convert.folder import DRAFT_META
from qspec_core.errors import QspecError
from qspec_core.model.transformer import Transformer, linear_layers


def convert_steps(model: Transformer, draft: bool = True, recipe=None) -> int:
    """How many times `convert(..., on_layer=...)` (or `add_int8_weights`) calls `on_layer`:
    once per linear layer for its INT8 weights, and once more for its 4-bit draft when one is
    made (not when it is imported, nor when only the INT8 weights are; with a `recipe`, for
    the layers it selects)."""
    names = linear_layers(model)
    drafted = sum(map(recipe.selects, names)) if recipe is not None else len(names)
    return len(names) + (drafted if draft else 0)


def read_draft_meta(folder: Path) -> dict:
    """The metadata of a converted folder (method, group size, modules, report, ...)."""
    path = Path(folder) / DRAFT_META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise QspecError(f"{folder} is not a converted model: it has no {DRAFT_META}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QspecError(f"corrupt {path}: {e}") from None
    if not isinstance(meta, dict):
        raise QspecError(f"corrupt {path}: expected a JSON object, not {type(meta).__name__}")
    return meta


def weight_error_summary(report: DraftReport) -> tuple[float, str, float]:
    """(mean, name of the worst layer, its error) of the drafts' relative weight errors."""
    if not report.rel_weight_error:
        raise ValueError("the report has no layers")
    errors = report.rel_weight_error
    worst = max(errors, key=errors.get)  # the first of equals, as a stable sort would give
    return sum(errors.values()) / len(errors), worst, errors[worst]
