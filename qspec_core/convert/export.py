"""`qspec convert --export-gptq`: the draft as a standard GPTQ checkpoint folder that other
tools load whole (weights, config and the tokenizer files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qspec_core.errors import QspecError
from qspec_core.model.transformer import Transformer, linear_layers

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


def export_gptq(model: Transformer, hf_config: dict, out: Path) -> Path:
    """Write the model's draft weights as a standard GPTQ (v1) checkpoint.

    Quantized modules become qweight/qzeros/scales/g_idx; every other tensor (embeddings,
    norms, modules the draft left in full precision) is written as is.
    """
    from qspec_core.convert.formats import Int4Weight, write_gptq_checkpoint

    weights, other = {}, {}
    drafted = {n for n, m in linear_layers(model).items() if m.draft is not None}
    for name, layer in linear_layers(model).items():
        d = layer.draft
        if d is None:
            continue
        if d.input_scale is not None:
            raise QspecError(
                f"cannot export as GPTQ: {name} carries explicit activation scales "
                "(an AWQ draft), which GPTQ checkpoints cannot hold"
            )
        g_idx = None
        q = d.unpacked()
        if d.perm is not None:
            q = torch.empty_like(q).index_copy_(1, d.perm, q)  # back to input order
            g_idx = (
                torch.empty_like(d.perm)
                .index_copy_(0, d.perm, torch.arange(d.in_features) // d.group_size)
                .int()
            )
        weights[name] = Int4Weight(q, d.scale.float(), d.zero.float(), d.group_size, g_idx)
        if d.bias is not None:
            other[f"{name}.bias"] = d.bias.half()
    for name, tensor in model.state_dict().items():
        module, kind = name.rsplit(".", 1)
        if ".draft." in name or ".int8." in name:
            continue  # qspec's own twins: not part of a GPTQ checkpoint
        if module in drafted and kind in ("weight", "bias"):
            continue  # the 4-bit twin (and its bias) replaces it
        other[name] = tensor.half() if tensor.is_floating_point() else tensor
    desc_act = any(w.g_idx is not None for w in weights.values())
    try:
        return write_gptq_checkpoint(out, weights, other, hf_config, sym=False, desc_act=desc_act)
    except ValueError as e:  # e.g. a dimension the GPTQ packing cannot take
        raise QspecError(f"cannot export as GPTQ: {e}") from None
