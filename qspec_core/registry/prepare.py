"""A named model's converted folder (4-bit GPTQ draft + INT8 verifier weights): made by an
explicit step, once, into the qspec cache; loading never converts (`runtime.load_runtime`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from qspec_core.convert.convert import INT8_METHOD, add_int8_weights, convert
from qspec_core.convert.folder import DRAFT_META
from qspec_core.convert.info import convert_steps
from qspec_core.convert.recipes import get_recipe
from qspec_core.documents import read_document
from qspec_core.model.checkpoint import load_model
from qspec_core.model.tokenizer import Tokenizer
from qspec_core.paths import BUNDLED_TEXTS, models_dir
from qspec_core.precision import INT8_WEIGHTS
from qspec_core.registry.sources import (
    DEFAULT_MODEL,
    RegistryModel,
    ensure_registry_model,
    find_named_model,
)

DRAFT_SUFFIX = "-qspec-gptq"
DEFAULT_DRAFT = DEFAULT_MODEL.name + DRAFT_SUFFIX
CALIB_TOKENS = 1024  # of the bundled GPL text, for the named models' GPTQ draft and INT8
CALIB_TEXT = "gpl-3.0.txt"


def converted_folder(model: RegistryModel) -> Path:
    return models_dir() / (model.name + DRAFT_SUFFIX)


def conversion_needed(model: RegistryModel) -> str | None:
    """Why `prepare_named` still has work to do for `model`, or None when it has none."""
    meta = converted_folder(model) / DRAFT_META
    if not meta.exists():
        return "no 4-bit draft yet"
    meta = json.loads(meta.read_text())
    recipe = draft_recipe(meta)
    if recipe != model.draft_recipe:
        return f"its 4-bit draft is from an older recipe ({recipe}; now {model.draft_recipe})"
    int8 = meta.get("target_int8") or {}
    if int8.get("method") != INT8_METHOD:  # made before INT8 verification, or RTN INT8
        return "its INT8 verifier weights are from an older qspec"
    return None


def draft_recipe(meta: dict) -> str:
    """The recipe a converted folder's draft was made with; folders from before recipes were
    made as `gptq` makes them."""
    return (meta.get("recipe") or {}).get("name", "gptq")


Progress = Callable[[int], Callable[[str], None]]  # total steps -> a callback per step


def prepare_named(
    model: RegistryModel, log: Callable[[str], None] = print, progress: Progress | None = None
) -> Path:
    """Make `model`'s converted folder if `conversion_needed` says so (a GPTQ calibration of
    a minute or two for the default model), saying so through `log`; `progress(total)`
    returns the callback called after each of `total` layer steps. Returns the folder."""
    target = converted_folder(model)
    if conversion_needed(model) is None:
        return target
    calib = BUNDLED_TEXTS / CALIB_TEXT
    calib_source = f"qspec_core/data/{CALIB_TEXT}"
    meta = target / DRAFT_META
    # only the INT8 weights are missing (else the whole folder is made again)
    upgrade = meta.exists() and draft_recipe(json.loads(meta.read_text())) == model.draft_recipe
    if upgrade:
        folder = target
        log(f"making {target.name}'s INT8 verifier weights (GPTQ, once)")
    else:
        folder = ensure_registry_model(model, log)
        log(f"making {model.name}'s 4-bit draft and INT8 verifier weights (GPTQ, once) in {target}")
    weights = load_model(folder, dtype=torch.float32)
    ids = Tokenizer(folder).encode(read_document(calib))[:CALIB_TOKENS]
    recipe = get_recipe(model.draft_recipe)
    steps = convert_steps(weights, not upgrade, recipe)
    on_layer = progress(steps) if progress else None
    if upgrade:
        add_int8_weights(target, weights, ids, calib_source, on_layer)
    else:
        convert(folder, target, weights, calib_ids=ids, calib_source=calib_source, force=True,
                on_layer=on_layer, recipe=recipe)  # fmt: skip
    return target


def converted_model_for(
    spec: str | None, need_draft: bool, target_weights: str = "full"
) -> RegistryModel | None:
    """The named model (the default included) whose converted folder a run of `spec` needs:
    one that runs the 4-bit draft or the INT8 weights (int8, w8a8); None for anything else
    (a folder, a file, a hub id, or a run that needs neither)."""
    if not (need_draft or target_weights in INT8_WEIGHTS):
        return None
    return DEFAULT_MODEL if spec in (None, "default") else find_named_model(spec)


def prepare_for(
    spec: str | None,
    need_draft: bool,
    target_weights: str = "full",
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> Path | None:
    """The explicit step before `load_runtime(spec, need_draft=..., target_weights=...)`: a
    named model (the default included) that needs its converted folder gets it made now.
    None when `spec` needs nothing made (a folder, a file, a hub id, or no draft needed)."""
    named = converted_model_for(spec, need_draft, target_weights)
    return None if named is None else prepare_named(named, log, progress)
