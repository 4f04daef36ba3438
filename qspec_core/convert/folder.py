"""A converted model folder: the checkpoint, plus `draft.safetensors` (4-bit twins and INT8
weights of every linear) and `qspec_draft.json` (what made them). Writing it whole or not at
all, and attaching its twins to a loaded model (`load_converted`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from qspec_core.errors import QspecError, disk_space
from qspec_core.model.checkpoint import TensorFile, checkpoint_files, load_model
from qspec_core.model.transformer import Transformer, attach_draft, attach_int8, linear_layers
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear

DRAFT_META = "qspec_draft.json"
DRAFT_WEIGHTS = "draft.safetensors"
FORMAT_VERSION = 1
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "qspec_source.json",
)


def write_folder(source: Path, out: Path, tensors: dict, meta: dict) -> None:
    """Write everything into a temporary sibling, then rename: no half-written model."""
    with staged_folder(source, out) as tmp:
        save_file(tensors, tmp / DRAFT_WEIGHTS, metadata={"format": "qspec-draft"})
        (tmp / DRAFT_META).write_text(json.dumps(meta, indent=2) + "\n")


@contextmanager
def staged_folder(source: Path, out: Path):
    """A temporary sibling of `out` to write the draft files into; when the block ends without
    an exception, the source's config, tokenizer and weights (hard links where it can) join
    them and the folder is renamed to `out` (replacing it). On any exception, Ctrl-C included,
    nothing is left."""
    try:
        with disk_space(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    except OSError as e:
        raise QspecError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        with disk_space(out):
            yield tmp
            for name in COPIED:
                if (source / name).exists():
                    shutil.copy2(source / name, tmp / name)
            weight_files = checkpoint_files(source)
            index = source / "model.safetensors.index.json"
            for f in weight_files + ([index] if index.exists() else []):
                try:
                    os.link(f, tmp / f.name)  # same weights, no copy
                except OSError:
                    shutil.copy2(f, tmp / f.name)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_draft(
    folder: Path, model: Transformer, with_draft: bool = True, with_int8: bool = True
) -> dict | None:
    """Attach the 4-bit draft and INT8 twins of a converted folder to `model`; returns its
    metadata. `with_draft` False: no 4-bit twins; `with_int8` False: INT8 twins only of the
    layers the draft runs on them (those without a 4-bit twin), none without the draft: a run
    on the full weights does not hold twins it never reads."""
    meta_path = folder / DRAFT_META
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise QspecError(f"corrupt {meta_path}: {e}") from None
    if meta.get("format_version") != FORMAT_VERSION or meta.get("bits") != 4:
        raise QspecError(
            f"{meta_path}: unsupported draft format (version "
            f"{meta.get('format_version')}, {meta.get('bits')} bits)"
        )
    layers = linear_layers(model)

    def int4(target, state):
        G = meta["group_size"]
        bias, perm, scaled = "bias" in state, "perm" in state, "input_scale" in state
        return Int4Linear(target.in_features, target.out_features, G, bias, perm, scaled)

    def int8(target, state):
        return Int8Linear(target.in_features, target.out_features, bias="bias" in state)

    int8_modules = (meta.get("target_int8") or {}).get("modules", [])
    draft_modules = meta["modules"] if with_draft else []
    if not with_int8:  # (what the draft reads on INT8: its layers without a 4-bit twin)
        int8_modules = [m for m in int8_modules if with_draft and m not in set(draft_modules)]
    try:  # (plain reads: `TensorFile`; the twins are the run's weights, held once)
        f = TensorFile(folder / DRAFT_WEIGHTS)
        drafts = _load_twins(f, draft_modules, layers, "draft", int4, model.device)
        int8s = _load_twins(f, int8_modules, layers, "int8", int8, model.device)
    except QspecError as e:
        raise QspecError(f"corrupt draft weights in {folder}: {e}") from None
    attach_draft(model, drafts)
    attach_int8(model, int8s)
    return meta


def _load_twins(f, modules: list[str], layers: dict, kind: str, make, device) -> dict:
    """The `kind` twins ("draft": 4-bit, "int8") of `modules` from the open safetensors `f`,
    each checked against the empty twin `make(target layer, its tensors)` builds."""
    names = set(f.keys())
    out = {}
    for module in modules:
        if module not in layers:
            raise QspecError(f"{kind} module {module} does not exist in the target model")
        prefix = f"{module}.{kind}."
        state = {n[len(prefix) :]: f.get_tensor(n) for n in names if n.startswith(prefix)}
        twin = make(layers[module], state)
        want = twin.state_dict()
        if state.keys() != want.keys():
            raise QspecError(f"{kind} weights of {module} are incomplete")
        for key, t in state.items():
            if t.shape != want[key].shape:
                raise QspecError(
                    f"{kind} {module}.{key} has shape {list(t.shape)}, "
                    f"expected {list(want[key].shape)}"
                )
        twin.load_state_dict(state)
        out[module] = twin.to(device)
    return out


def load_converted(folder: Path, dtype=torch.bfloat16, device="cpu") -> Transformer:
    """`load_model` plus the folder's 4-bit draft and INT8 weights, if it has them."""
    model = load_model(folder, dtype=dtype, device=device)
    load_draft(folder, model)
    return model


def int8_modules(folder: Path) -> list[str]:
    """The linears a converted folder has INT8 weights of (none for any other folder)."""
    try:
        meta = json.loads((folder / DRAFT_META).read_text())
        return list((meta.get("target_int8") or {}).get("modules", []))
    except (OSError, ValueError, AttributeError):
        return []  # (`load_draft` says what is wrong with a damaged one)
