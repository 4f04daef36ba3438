"""`qspec convert`: a model folder with full-precision target weights and 4-bit draft weights.

Output folder (accepted by `--model` everywhere):
    config.json, tokenizer files          copied from the source
    model*.safetensors (+ index)          the target weights (hard links when possible)
    draft.safetensors                     "<linear>.draft.{packed,scale,zero[,bias,perm]}"
                                          and the INT8 verifier's weights (Quasar),
                                          "<linear>.int8.{weight_int8,weight_scale[,bias]}"
    qspec_draft.json                      method, bits, group size, symmetric, modules,
                                          calibration source, source-weight hashes, report;
                                          "target_int8": the INT8 weights' scheme and modules
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

import qspec_core
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.convert.folder import (
    DRAFT_META,
    DRAFT_WEIGHTS,
    FORMAT_VERSION,
    write_folder,
)
from qspec_core.convert.recipes import Recipe
from qspec_core.errors import QspecError, disk_space
from qspec_core.model.checkpoint import checkpoint_files
from qspec_core.model.transformer import (
    Transformer,
    attach_draft,
    attach_int8,
    forward_logits,
    linear_layers,
)
from qspec_core.paths import sha256_file
from qspec_core.precision import DRAFT_W4, FP, Precision
from qspec_core.quant.awq import ActivationCollector, awq_quantize
from qspec_core.quant.gptq import (
    HessianCollector,
    SharedFactors,
    gptq_quantize,
    gptq_quantize_both,
    gptq_quantize_int8,
)
from qspec_core.quant.int4 import Int4Linear, rtn_quantize
from qspec_core.quant.int8 import Int8Linear

METHODS = ("rtn", "gptq", "awq")
UPPER = "int8-upper"  # the draft is the upper nibble of the INT8 weights (a recipe only)


@dataclass
class DraftReport:
    """What the conversion cost: weight error per layer, draft vs target on calibration."""

    rel_weight_error: dict[str, float] = field(default_factory=dict)
    top1_agreement: float = 0.0  # draft weights vs target weights, full-precision KV
    kl: float = 0.0  # mean KL(p_target || p_draft) per position, nats
    tokens: int = 0


def default_group_size(model: Transformer) -> int:
    """128 (the common choice) when every in_features allows it, else 64.

    Never 32 by default: the default model's weights already lie on a 4-bit group-32 grid,
    where an asymmetric group-32 draft would equal the target exactly.
    """
    sizes = [m.in_features for m in linear_layers(model).values()]
    return 128 if all(k % 128 == 0 for k in sizes) else 64


def _forward_logits(model: Transformer, ids: list[int], path: Precision) -> torch.Tensor:
    """All-position logits [T, V] with full-precision KV (weights per `path`), from the model
    itself: conversion runs with no runner, so the calibration hooks (`HessianCollector`,
    `ActivationCollector`) see every linear's module call on PyTorch's ops."""
    cache = FullPrecisionCache(model.config, len(ids), dtype=model.dtype, device=model.device)
    return forward_logits(model, cache, ids, path, 512)


def draft_agreement(model: Transformer, ids: list[int]) -> tuple[float, float]:
    """Top-1 agreement and mean KL of the draft weights vs the target weights (fp KV)."""
    same, kl = agreement_rows(
        _forward_logits(model, ids, FP), _forward_logits(model, ids, DRAFT_W4)
    )
    return float(same.mean()), float(kl.mean())


def agreement_rows(target_logits: torch.Tensor, draft_logits: torch.Tensor):
    """Per position of logits [T, V]: whether the argmaxes agree (1.0 or 0.0) [T], and
    KL(p_target || p_draft) in nats [T]. Row by row, so a caller may feed blocks of rows."""
    target = torch.log_softmax(target_logits, -1)
    draft = torch.log_softmax(draft_logits, -1)
    return (target.argmax(-1) == draft.argmax(-1)).float(), (target.exp() * (target - draft)).sum(
        -1
    )


def import_draft(model: Transformer, checkpoint: Path) -> tuple[dict[str, Int4Linear], dict]:
    """4-bit twins from an existing GPTQ or AWQ checkpoint of the same model."""
    from qspec_core.convert.formats import read_quantized_checkpoint

    info, weights, other = read_quantized_checkpoint(checkpoint)
    layers = linear_layers(model)
    for name, w in weights.items():
        if name not in layers:
            raise QspecError(f"{checkpoint}: quantized module {name} is not in the target model")
        target = layers[name]
        if w.shape != (target.out_features, target.in_features):
            raise QspecError(
                f"{checkpoint}: {name} is {list(w.shape)}, the target's is "
                f"{[target.out_features, target.in_features]}"
            )
    drafts = {}
    for name, w in weights.items():
        bias = other.get(f"{name}.bias")
        try:
            drafts[name] = Int4Linear.from_int4_weight(w, None if bias is None else bias.float())
        except ValueError as e:
            raise QspecError(f"{checkpoint}: {name}: {e}") from None
    if info.method == "awq":
        drafts = unfold_awq_scales(model, drafts, other, checkpoint)
    else:
        _check_same_norms(model, other, checkpoint)
    meta = {
        "method": f"import-{info.method}",
        "group_size": info.group_size,
        "sym": info.sym,
        "desc_act": info.desc_act,
        "checkpoint_format": info.checkpoint_format,
        "import_source": str(checkpoint),
    }
    return drafts, meta


def _norm_pairs(model: Transformer) -> list[tuple[str, list[str]]]:
    """(norm, linears reading its output) per decoder layer, as AWQ scales them; none for a
    post-norm layer (OLMo 2), whose norms read the linears' outputs instead."""
    pairs = []
    if model.config.layer.norm_placement != "pre":
        return pairs
    for i in range(model.config.num_hidden_layers):
        p = f"layers.{i}."
        pairs.append(
            (
                p + "input_layernorm.weight",
                [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
            )
        )
        pairs.append(
            (p + "post_attention_layernorm.weight", [p + "mlp.gate_proj", p + "mlp.up_proj"])
        )
    return pairs


def _check_same_norms(model: Transformer, other: dict, checkpoint: Path) -> None:
    params = dict(model.named_parameters())
    for norm, _ in _norm_pairs(model):
        if norm in other and not torch.allclose(
            other[norm].float(), params[norm].float(), rtol=1e-2, atol=1e-3
        ):
            raise QspecError(
                f"{checkpoint}: {norm} differs from the target model's: the "
                "checkpoint is of another model (or another fine-tune)"
            )


def unfold_awq_scales(model: Transformer, drafts: dict, other: dict, checkpoint: Path) -> dict:
    """Undo AutoAWQ's scale folding for a draft that shares the target's norms and KV.

    AutoAWQ divides each norm by per-channel scales s and multiplies the columns of the
    linears after it by s; with the MHA layout it also divides v_proj's rows and multiplies
    o_proj's columns (and does the same for up_proj/down_proj, which cancels inside the MLP).
    Norm scales are exact (s = target norm / checkpoint norm): those linears get input scale
    1/s. The v_proj scales live only in the weights: estimated per row by least squares
    against the target's v_proj; v_proj then gets output scale s (its V enters the shared
    cache) and o_proj input scale 1/s.
    """
    if model.config.layer.norm_placement != "pre":
        raise QspecError(
            f"{checkpoint}: AWQ checkpoints of a post-norm model ({model.config.model_type}) "
            "cannot be imported; use --method gptq or awq to quantize it here"
        )
    params = dict(model.named_parameters())
    layers = linear_layers(model)
    drafts = dict(drafts)
    for norm, names in _norm_pairs(model):
        if norm not in other:
            continue
        awq, target = other[norm].float(), params[norm].float()
        ratio = torch.where(
            target != 0,
            awq / target.where(target != 0, torch.ones_like(target)),
            torch.ones_like(target),
        )  # = 1/s per channel
        for name in names:
            if name in drafts:
                drafts[name] = drafts[name].with_scales(input_scale=ratio)
    for i in range(model.config.num_hidden_layers):
        v, o = f"layers.{i}.self_attn.v_proj", f"layers.{i}.self_attn.o_proj"
        if v not in drafts or o not in drafts or layers[v].out_features != layers[o].in_features:
            continue
        w_t = layers[v].weight.data.float()
        w_a = drafts[v].effective_weight()
        s = (w_t * w_t).sum(1) / (w_t * w_a).sum(1).clamp(min=1e-12)  # w_a ~ w_t / s per row
        if (s - 1).abs().max() > 0.02:  # folded (quantization noise alone stays well below)
            drafts[v] = drafts[v].with_scales(drafts[v].input_scale, output_scale=s)
            prev_in = drafts[o].input_scale
            drafts[o] = drafts[o].with_scales(
                input_scale=(1 / s) * (1 if prev_in is None else prev_in)
            )
    return drafts


def calibration_hessians(model: Transformer, calib_ids: list[int]) -> dict[str, torch.Tensor]:
    """H = 2 X^T X of every linear layer's inputs on the calibration text (fp weights and KV)."""
    collector = HessianCollector(linear_layers(model))
    try:
        _forward_logits(model, calib_ids, FP)  # all positions, so lm_head sees them too
    finally:
        collector.close()
    return collector.hessians


def quantize_model(
    model: Transformer,
    method: str,
    group_size: int,
    calib_ids: list[int],
    on_layer=None,
    hessians: dict[str, torch.Tensor] | None = None,
    select=None,
    damp: float = 0.01,
    made: dict[str, tuple] | None = None,
) -> dict[str, Int4Linear]:
    """4-bit twins of every linear layer (lm_head included), or of those `select(name)`
    accepts (`Recipe.selects`), by RTN, GPTQ (damping `damp`) or AWQ.

    GPTQ uses `hessians` when given (from `calibration_hessians` on `calib_ids`), and the
    (q, scale, zero) of `made` (`gptq_pairs`) where it has them."""
    check_method(method, group_size)
    layers = linear_layers(model)
    if method == "gptq" and hessians is None:
        hessians = calibration_hessians(model, calib_ids)
    collector = None
    if method == "awq":
        collector = ActivationCollector(layers)
        try:
            _forward_logits(model, calib_ids, FP)
        finally:
            collector.close()
    return quantize_layers(layers, method, group_size, on_layer, hessians, select, damp, made,
                           collector)  # fmt: skip


def check_method(method: str, group_size: int) -> None:
    if method not in METHODS:
        raise QspecError(f"unknown method {method!r} (have: {', '.join(METHODS)})")
    if group_size < 2 or group_size % 2:
        raise QspecError(f"group size must be an even number >= 2, not {group_size}")


def quantize_layers(
    layers: dict[str, torch.nn.Module],
    method: str,
    group_size: int,
    on_layer=None,
    hessians: dict[str, torch.Tensor] | None = None,
    select=None,
    damp: float = 0.01,
    made: dict[str, tuple] | None = None,
    activations: ActivationCollector | None = None,
    factors: SharedFactors | None = None,
) -> dict[str, Int4Linear]:
    """The 4-bit twins of `layers` (linears by HF name; those `select` accepts) from their own
    weights: RTN, GPTQ with `hessians` (or the codes `made` has), AWQ with the `activations`
    its calibration collected. `on_layer(name)` after each one made here. `factors`: GPTQ's
    H^-1 factors shared across calls (`SharedFactors`; None: across this call's linears)."""
    made = made or {}
    drafts, factors = {}, factors or SharedFactors()  # (q/k/v, gate/up: one factor each)
    for name, layer in layers.items():
        if select is not None and not select(name):
            continue
        weight = layer.weight.data.float()
        bias = None if layer.bias is None else layer.bias.data.float()
        if method == "awq":
            q, scale, zero, input_scale = awq_quantize(
                weight, activations.absmean[name], activations.sample[name], group_size
            )
            draft = Int4Linear.from_quantized(q, scale, zero, group_size, bias)
            draft = draft.with_scales(input_scale=input_scale)
        else:
            if method == "gptq" and name in made:
                q, scale, zero = made[name]
            elif method == "gptq":
                q, scale, zero = gptq_quantize(weight, hessians[name], group_size, damp,
                                               factors=factors)  # fmt: skip
            else:
                q, scale, zero = rtn_quantize(weight, group_size)
            draft = Int4Linear.from_quantized(q, scale, zero, group_size, bias)
        drafts[name] = draft
        if on_layer and name not in made:
            on_layer(name)
    return drafts


def upper_drafts(int8_twins: dict, group_size: int, select=None, on_layer=None) -> dict:
    """The `int8-upper` drafts: the upper nibble of each INT8 twin `select` accepts."""
    drafts = {
        name: Int4Linear.from_int8_upper(t.weight_int8, t.weight_scale, t.bias, group_size)
        for name, t in int8_twins.items()
        if select is None or select(name)
    }
    for name in drafts:
        if on_layer:
            on_layer(name)
    return drafts


def weight_errors(drafts: dict[str, Int4Linear], layers: dict) -> dict[str, float]:
    """Each draft's relative weight error against its layer's weight (the report's)."""
    errors = {}
    for name, draft in drafts.items():
        w = layers[name].weight.data.float()
        errors[name] = float((draft.effective_weight() - w).norm() / w.norm())
    return errors


def check_output(source: Path, out: Path, force: bool) -> None:
    """Refuse an output folder that holds something (without `force`) or is the source."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise QspecError(f"{out} exists and is not empty; pass --force to replace it")
    if out.resolve() == source.resolve():
        raise QspecError("the output folder must differ from the source model folder")


def convert(
    source: Path,
    out: Path,
    model: Transformer,
    method: str = "rtn",
    group_size: int | None = None,
    calib_ids: list[int] | None = None,
    calib_source: str = "",
    force: bool = False,
    on_layer=None,
    draft_from: Path | None = None,
    recipe: Recipe | None = None,
) -> DraftReport:
    """Quantize `model` (loaded from `source`), or import its draft from a GPTQ/AWQ
    checkpoint (`draft_from`), and write the converted folder `out`, with the INT8 verifier's
    weights. A `recipe` (`convert.recipes`) gives the method, group size, the layers that get
    a 4-bit twin and GPTQ's damping, in place of `method` and `group_size`. `on_layer(name)`
    is called after each layer's draft and each layer's INT8 (`info.convert_steps`)."""
    check_output(source, out, force)
    calib_ids = calib_ids or []
    t0 = time.perf_counter()
    extra = {}
    if recipe is not None:
        method, group_size = recipe.method, recipe.group_size
        extra["recipe"] = recipe.to_dict()
    if draft_from is None:
        group_size = group_size or default_group_size(model)
        if method in ("gptq", "awq") and len(calib_ids) < 64:
            raise QspecError(
                f"{method.upper()} needs a calibration text of at least 64 tokens (--calib)"
            )
    # One calibration pass serves GPTQ's draft and the INT8 verifier's (GPTQ) rounding.
    hessians = calibration_hessians(model, calib_ids) if len(calib_ids) >= 64 else None
    if draft_from is not None:
        drafts, extra = import_draft(model, draft_from)
        method, group_size = extra.pop("method"), extra.pop("group_size")
    paired = {}
    if draft_from is None and method == "gptq" and hessians is not None:
        damp = 0.01 if recipe is None else recipe.damp
        select = None if recipe is None else recipe.selects
        paired = gptq_pairs(linear_layers(model), hessians, group_size, damp, select, on_layer)
    # the INT8 verifier's weights first: a layer left out of the draft drafts on them
    int8_twins, int8_meta = int8_weights(
        model, hessians, calib_source, on_layer, {n: p[1] for n, p in paired.items()}
    )
    attach_int8(model, int8_twins)
    if draft_from is None and method == UPPER:
        select = recipe.selects if recipe is not None else None
        drafts = upper_drafts(int8_twins, group_size or 64, select, on_layer)
    elif draft_from is None:
        select = None if recipe is None else recipe.selects
        damp = 0.01 if recipe is None else recipe.damp
        drafts = quantize_model(
            model, method, group_size, calib_ids, on_layer, hessians, select, damp,
            {n: p[0] for n, p in paired.items()},
        )  # fmt: skip
    report = DraftReport(tokens=len(calib_ids))
    report.rel_weight_error = weight_errors(drafts, linear_layers(model))
    attach_draft(model, drafts)
    if calib_ids:
        report.top1_agreement, report.kl = draft_agreement(model, calib_ids[:1024])
    meta = draft_meta(source, method, group_size, extra, sorted(drafts), calib_source, report, t0)
    tensors = twin_tensors(drafts, "draft") | twin_tensors(int8_twins, "int8")
    meta["target_int8"] = int8_meta
    write_folder(source, out, tensors, meta)
    return report


def draft_meta(
    source: Path,
    method: str,
    group_size: int,
    extra: dict,
    modules: list[str],
    calib_source: str,
    report: DraftReport,
    started: float,
) -> dict:
    """qspec_draft.json of a conversion that started at `started` (perf_counter), but for its
    "target_int8" (`int8_meta`)."""
    return {
        "format_version": FORMAT_VERSION,
        "qspec_version": qspec_core.__version__,
        "method": method,
        "bits": 4,
        "group_size": group_size,
        "sym": extra.pop("sym", False),
        "zero_point": "integer",
        **extra,
        "modules": modules,
        "calibration": {"source": calib_source, "tokens": report.tokens},
        "source": {
            "path": str(source.resolve()),
            "files": {f.name: sha256_file(f) for f in checkpoint_files(source)},
        },
        "seconds": round(time.perf_counter() - started, 2),
        "report": {
            "top1_agreement": report.top1_agreement,
            "kl": report.kl,
            "rel_weight_error": report.rel_weight_error,
        },
    }


def gptq_pairs(
    layers: dict[str, torch.nn.Module],
    hessians: dict[str, torch.Tensor],
    group_size: int,
    damp: float,
    select=None,
    on_layer=None,
    factors: SharedFactors | None = None,
) -> dict[str, tuple[tuple, tuple]]:
    """GPTQ's 4-bit codes and the INT8 verifier's of each layer both get, made in one sweep
    (`gptq_quantize_both`) where the two roundings would share their H^-1 (the same damping as
    the INT8 weights'): name -> ((q, scale, zero), (q_int8, scale_int8)). The rest is made by
    `quantize_model` and `int8_weights` alone, which count only what they make with
    `on_layer` (called here twice a pair: a step for each weight set, as `convert_steps` has)."""
    if damp != INT8_DAMP:
        return {}
    pairs, factors = {}, factors or SharedFactors()
    for name, layer in layers.items():
        if select is None or select(name):
            pairs[name] = gptq_quantize_both(
                layer.weight.data, hessians[name], group_size, damp, factors=factors
            )
            if on_layer:
                on_layer(name)
                on_layer(name)
    return pairs


def twin_tensors(twins: dict[str, torch.nn.Module], kind: str) -> dict[str, torch.Tensor]:
    """draft.safetensors' entries of twins by linear name: "<linear>.<kind>.<buffer>"."""
    return {
        f"{name}.{kind}.{key}": t.contiguous()
        for name, twin in twins.items()
        for key, t in twin.state_dict().items()
    }


INT8_SCHEME = "per-output-channel symmetric INT8, scale max|w|/127"
# The INT8 weights' rounding: "gptq" when the folder was converted with a calibration text,
# "rtn" (round to nearest) otherwise. A folder whose INT8 weights are older or RTN is
# upgraded once by `registry.prepare.prepare_named` (the default model's cache).
INT8_METHOD = "gptq"
INT8_DAMP = 0.01  # GPTQ's damping for the INT8 weights


def int8_weights(
    model: Transformer,
    hessians: dict[str, torch.Tensor] | None = None,
    calib_source: str = "",
    on_layer=None,
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[dict[str, Int8Linear], dict]:
    """The INT8 verifier's weights (`--target-weights int8`): every linear layer on the
    per-output-channel grid, rounded by GPTQ with `hessians` (from `calibration_hessians`) or
    to nearest without. No activation smoothing (see docs/DESIGN.md). Returns the twins by
    linear name (`twin_tensors` gives their draft.safetensors entries) and their metadata.
    `made`: (q_int8, scale) already rounded with `hessians` (`gptq_pairs`), by linear name."""
    layers = linear_layers(model)
    twins = int8_twins(layers, hessians, on_layer, made)
    return twins, int8_meta(sorted(layers), hessians is not None, calib_source)


def int8_twins(
    layers: dict[str, torch.nn.Module],
    hessians: dict[str, torch.Tensor] | None = None,
    on_layer=None,
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    release: bool = False,
    factors: SharedFactors | None = None,
) -> dict[str, Int8Linear]:
    """`int8_weights`' twins of `layers` (linears by HF name). `release`: each Hessian is
    dropped from `hessians`, its storage freed once its factor exists (nothing after needs
    it). `factors`: shared across calls (`SharedFactors`; None: across this call's)."""
    twins, made, factors = {}, made or {}, factors or SharedFactors()
    for name, layer in layers.items():
        if hessians is None:
            q = Int8Linear.from_linear(layer)
        else:
            hessian = hessians.pop(name) if release else hessians[name]
            w_int8, scale = made.get(name) or gptq_quantize_int8(
                layer.weight.data, hessian, INT8_DAMP, factors=factors, release=release
            )
            del hessian
            bias = None if layer.bias is None else layer.bias.data.float()
            q = Int8Linear.from_quantized(w_int8, scale, bias)
        twins[name] = q
        if on_layer and name not in made:
            on_layer(name)
    return twins


def int8_meta(modules: list[str], calibrated: bool, calib_source: str) -> dict:
    """qspec_draft.json's "target_int8": the INT8 weights' scheme, rounding and modules."""
    return {
        "scheme": INT8_SCHEME,
        "method": "gptq" if calibrated else "rtn",
        "calibration": calib_source if calibrated else None,
        "smoothing": None,
        "modules": modules,
    }


def add_int8_weights(
    folder: Path,
    model: Transformer,
    calib_ids: list[int] | None = None,
    calib_source: str = "",
    on_layer=None,
) -> None:
    """Give a converted folder (new) INT8 weights, GPTQ-rounded on `calib_ids` when given,
    replacing any it has (atomically)."""
    from safetensors.torch import load_file

    meta = json.loads((folder / DRAFT_META).read_text())
    tensors = {k: v for k, v in load_file(folder / DRAFT_WEIGHTS).items() if ".int8." not in k}
    hessians = calibration_hessians(model, calib_ids) if calib_ids else None
    twins, meta["target_int8"] = int8_weights(model, hessians, calib_source, on_layer)
    extra = twin_tensors(twins, "int8")
    tmp_weights = folder / f".{DRAFT_WEIGHTS}.tmp"
    tmp_meta = folder / f".{DRAFT_META}.tmp"
    try:
        with disk_space(folder):
            save_file(tensors | extra, tmp_weights, metadata={"format": "qspec-draft"})
            tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp_weights, folder / DRAFT_WEIGHTS)
            os.replace(tmp_meta, folder / DRAFT_META)
    finally:
        tmp_weights.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
