"""`qspec convert` one decoder layer at a time: the memory of about one layer, whatever the
model's size (as GPTQModel and llm-compressor convert).

The model is a skeleton on the meta device (no memory). The calibration text's hidden states
go through the layers in order: each layer's weights are read from the memory-mapped
checkpoint in fp32 (`CheckpointReader`), the states run through it in chunks of `CHUNK`
tokens while hooks collect its linears' Hessians (and AWQ's statistics), its INT8 and 4-bit
twins are made by `convert.py`'s functions, appended to draft.safetensors
(`tensor_file.TensorFileWriter`: never all in memory), and the layer goes back to the meta
device. The final norm's output is lm_head's input; lm_head ([V, hidden]: the largest matrix
of most models, 2.1 GB in fp32 for Llama 3's vocabulary) is read and quantized in row blocks
of at most `HEAD_BLOCK_BYTES`.

The numbers are the whole-model conversion's (`convert.convert`), bit for bit where lm_head
is one block (tests/test_convert_stream.py): each layer computes what the model's forward
computed, on the same chunks in the same order, and the quantizers are the same functions on
the same inputs. A head of several blocks is rounded a block of rows at a time with the same
H^-1 (GPTQ's rows are independent; only the BLAS's rounding of the block updates may differ).
AWQ's scale search reads a layer's whole output, so its head is one block whatever its size.

The draft-vs-target report (top-1 agreement and KL on the first `REPORT_TOKENS` tokens) is
made the same way: a second stream of states through each layer's twins (the draft path,
full-precision KV), and the logits compared `REPORT_ROWS` positions at a time.

Peak memory (fp32): one layer's weights, its Hessians (down_proj's, intermediate^2, is the
largest) and GPTQ's work on one of them; the calibration states ([T, hidden], three streams
at most); at the end lm_head's twins (1.5 bytes a weight), one row block, and the report's
target logits [REPORT_TOKENS, V].
"""

from __future__ import annotations

import ctypes
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.reference import soft_cap
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.config import ModelConfig
from qspec_core.convert.convert import (
    INT8_DAMP,
    UPPER,
    DraftReport,
    agreement_rows,
    check_method,
    check_output,
    default_group_size,
    draft_meta,
    gptq_pairs,
    int8_meta,
    int8_twins,
    quantize_layers,
    twin_tensors,
    upper_drafts,
    weight_errors,
)
from qspec_core.convert.folder import DRAFT_META, DRAFT_WEIGHTS, staged_folder
from qspec_core.convert.info import convert_steps
from qspec_core.convert.recipes import Recipe
from qspec_core.convert.tensor_file import TensorFileWriter, header_room
from qspec_core.errors import QspecError
from qspec_core.families import family_for
from qspec_core.model.checkpoint import CheckpointReader, check_layer_count, split_fused
from qspec_core.model.rope import RotaryEmbedding
from qspec_core.model.transformer import Linear, Transformer, linear_layers, local_rope_config
from qspec_core.precision import DRAFT_W4, FP, Precision
from qspec_core.quant.awq import ActivationCollector
from qspec_core.quant.gptq import HessianCollector, SharedFactors
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear

CHUNK = 512  # calibration tokens per forward: `convert._forward_logits`' chunks (its bits)
REPORT_TOKENS = 1024  # the draft-vs-target report's tokens (`convert.draft_agreement`'s)
REPORT_ROWS = 128  # positions of the report's logits compared at once
HEAD_BLOCK_BYTES = 64 << 20  # lm_head rows read and quantized at once, in fp32 bytes
MIN_CALIBRATION = 64  # fewer calibration tokens: no Hessians (`convert.convert`'s rule)
INT8_METHODS = ("gptq", "rtn")  # the INT8 weights' rounding (`--int8`)
# every buffer a twin may write (Int4Linear's, Int8Linear's): the header's room is sized on them
TWIN_KEYS = {
    "draft": ("packed", "scale", "zero", "bias", "perm", "input_scale", "output_scale"),
    "int8": ("weight_int8", "weight_scale", "bias"),
}


class _LayerCache:
    """One layer's calibration KV: every layer index lands in slot 0 of a one-layer
    full-precision cache as long as the text (refilled for each layer), attending within that
    layer's sliding window."""

    def __init__(self, config: ModelConfig, n_tokens: int):
        # (no window of its own: the slot keeps every position, and masks by the layer's)
        one = replace(config, num_hidden_layers=1, layer_types=(), sliding_window=None)
        self._inner = FullPrecisionCache(one, n_tokens, dtype=torch.float32)
        self._windows = config.windows  # (the one slot takes each layer's in turn)
        self.rope_capacity = self._inner.rope_capacity

    def reset(self) -> None:
        self._inner.reset()

    def attend(self, layer, q, k, v, input_pos, path: Precision = FP):
        self._inner.windows = (self._windows[layer],)
        return self._inner.attend(0, q, k, v, input_pos, path)


class _Stream:
    """The hidden states of one text after the layers run so far: chunks [1, t, hidden], each a
    fresh tensor as the model's forward has them, run through each layer on `path`."""

    def __init__(self, chunks: list[torch.Tensor], config: ModelConfig, path: Precision):
        self.chunks = chunks
        self.path = path
        self.cache = _LayerCache(config, sum(x.shape[1] for x in chunks))

    def through(self, layer, rope) -> None:
        self.cache.reset()
        out, start = [], 0
        for x in self.chunks:
            pos = torch.arange(start, start + x.shape[1])
            cos, sin = rope(layer, pos, self.cache.rope_capacity)
            out.append(layer(x, cos, sin, pos, self.cache, self.path))
            start += x.shape[1]
        self.chunks = out


class _Rope:
    """The model's rotary embeddings (the local ones of Gemma 3's sliding layers too), real
    tensors beside the meta skeleton."""

    def __init__(self, config: ModelConfig):
        self.rotary = RotaryEmbedding(config)
        self.local = RotaryEmbedding(local_rope_config(config)) if config.layer.local_rope else None

    def __call__(self, layer, pos: torch.Tensor, capacity: int):
        if layer.local:
            return self.local(pos, torch.float32)
        return self.rotary(pos, torch.float32, capacity)


def convert_streaming(
    source: Path,
    out: Path,
    method: str = "rtn",
    group_size: int | None = None,
    calib_ids: list[int] | None = None,
    calib_source: str = "",
    force: bool = False,
    on_layer=None,
    recipe: Recipe | None = None,
    progress=None,
    int8_method: str = "gptq",
) -> DraftReport:
    """`convert.convert(source, out, model, ...)` (not an import: `--draft-from` loads the
    model), one layer at a time from the checkpoint (see the module docstring). `progress`:
    called with the number of steps (`info.convert_steps`) once the inputs are checked, it
    returns the `on_layer` callback (in place of `on_layer`). `int8_method`: the INT8
    weights' rounding, "gptq" (with a calibration text: `convert.convert`'s) or "rtn" (to
    nearest: with an RTN draft, no Hessian is collected, and no GPTQ runs)."""
    if int8_method not in INT8_METHODS:
        raise QspecError(f"INT8 rounding must be one of {', '.join(INT8_METHODS)}")
    check_output(source, out, force)
    started = time.perf_counter()
    calib_ids = list(calib_ids or [])
    extra, select, damp = {}, None, 0.01
    if recipe is not None:
        method, group_size = recipe.method, recipe.group_size
        extra["recipe"] = recipe.to_dict()
        select, damp = recipe.selects, recipe.damp
    config = ModelConfig.from_file(source / "config.json")
    reader = CheckpointReader(source)
    check_layer_count(config, reader.shapes)
    with torch.device("meta"):
        skeleton = Transformer(config)
    _check_tensors(skeleton, reader)
    group_size = group_size or default_group_size(skeleton)
    if method != UPPER:
        check_method(method, group_size)
    if method in ("gptq", "awq") and len(calib_ids) < MIN_CALIBRATION:
        raise QspecError(
            f"{method.upper()} needs a calibration text of at least 64 tokens (--calib)"
        )
    if progress is not None:
        on_layer = progress(convert_steps(skeleton, True, recipe))
    plan = _Plan(method, group_size, damp, select, on_layer, int8_method == "gptq")
    names = list(linear_layers(skeleton))
    room = header_room(
        [f"{n}.{kind}.{k}" for n in names for kind, keys in TWIN_KEYS.items() for k in keys],
        {"format": "qspec-draft"},
    )
    report = DraftReport(tokens=len(calib_ids))
    drafted: list[str] = []
    with staged_folder(source, out) as tmp, torch.inference_mode():
        writer = TensorFileWriter(tmp / DRAFT_WEIGHTS, room)
        try:
            streams = _streams(skeleton, reader, calib_ids, plan.calibrated(calib_ids))
            rope = _Rope(config)
            for i in range(config.num_hidden_layers):
                layer = _load_layer(skeleton, reader, i)
                twins = plan.layer(layer, f"layers.{i}.", streams, rope)
                drafted += _write(writer, twins, report)
                skeleton.layers[i] = layer.to("meta")  # (its weights and twins freed)
                _give_back()
            head = _Head(skeleton, reader, plan, streams)
            twins = head.quantize()
            drafted += _write(writer, twins, report)
            del twins  # (written: the report needs the draft's head only)
            if streams.report is not None:
                report.top1_agreement, report.kl = head.agreement()
            writer.close({"format": "qspec-draft"})
        except BaseException:
            writer.abort()
            raise
        meta = draft_meta(source, method, group_size, extra, sorted(drafted), calib_source,
                          report, started)  # fmt: skip
        int8_gptq = streams.calib is not None and plan.int8_gptq
        meta["target_int8"] = int8_meta(sorted(names), int8_gptq, calib_source)
        (tmp / DRAFT_META).write_text(json.dumps(meta, indent=2) + "\n")
    return report


def _check_tensors(skeleton: Transformer, reader: CheckpointReader) -> None:
    """The checkpoint's tensor table against the config's model, before anything is read
    (a family with fused tensors, Phi-3's, is checked layer by layer as they are split)."""
    config = skeleton.config
    family = family_for(config.model_type)
    if family is not None and family.fused:
        return
    want = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    have = dict(reader.shapes)
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
        have.pop("lm_head.weight", None)
    missing, unexpected = want.keys() - have.keys(), have.keys() - want.keys()
    if missing or unexpected:
        raise QspecError(
            "checkpoint does not match its config.json: "
            f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    for name, shape in want.items():
        if have[name] != shape:
            raise QspecError(
                f"checkpoint tensor {name} has shape {list(have[name])}, "
                f"config.json implies {list(shape)}"
            )


def _load_layer(skeleton: Transformer, reader: CheckpointReader, i: int) -> nn.Module:
    """Decoder layer i of the skeleton with its checkpoint weights in fp32."""
    prefix = f"layers.{i}."
    state = reader.state(prefix)
    family = family_for(skeleton.config.model_type)
    if family is not None and family.fused:
        state = split_fused(state, family.fused, skeleton)
    layer = skeleton.layers[i]
    want = {n: tuple(t.shape) for n, t in layer.state_dict().items()}
    state = {n.removeprefix(prefix): t for n, t in state.items()}
    if state.keys() != want.keys() or any(tuple(t.shape) != want[n] for n, t in state.items()):
        raise QspecError(f"checkpoint tensors of {prefix[:-1]} do not match its config.json")
    layer.load_state_dict(state, assign=True)
    return layer.requires_grad_(False)


class _Streams:
    """The texts that go through the layers: `calib` (the calibration text, with the hooks),
    `report` and `draft` (the report's first REPORT_TOKENS tokens, on the target's and the
    draft's weights); `report` is `calib` itself where they are the same text."""

    def __init__(self, calib, report, draft):
        self.calib, self.report, self.draft = calib, report, draft

    def fp(self) -> list[_Stream]:
        """The streams on the target's weights, each once."""
        if self.report is self.calib:
            return [self.calib] if self.calib is not None else []
        return [s for s in (self.calib, self.report) if s is not None]


def _streams(skeleton, reader, calib_ids: list[int], calibrated: bool) -> _Streams:
    config = skeleton.config
    calib = _Stream(_embed(config, reader, calib_ids), config, FP) if calibrated else None
    ids = calib_ids[:REPORT_TOKENS]
    if not ids:
        return _Streams(calib, None, None)
    same = calib is not None and len(ids) == len(calib_ids)
    report = calib if same else _Stream(_embed(config, reader, ids), config, FP)
    return _Streams(calib, report, _Stream(_embed(config, reader, ids), config, DRAFT_W4))


def _embed(config: ModelConfig, reader: CheckpointReader, ids: list[int]) -> list[torch.Tensor]:
    """`Transformer.embed` of `ids` in chunks of CHUNK: [1, t, hidden] each, the rows read from
    the checkpoint one by one (the table is the model's largest tensor but one)."""
    unique = sorted(set(ids))
    table = torch.cat([reader.rows("embed_tokens.weight", t, t + 1) for t in unique])
    where = {t: j for j, t in enumerate(unique)}
    chunks = []
    for start in range(0, len(ids), CHUNK):
        index = torch.tensor([where[t] for t in ids[start : start + CHUNK]])
        x = F.embedding(index[None], table)  # [1, t, hidden]
        if config.layer.embed_scale:  # (as Transformer.embed: the scale cast to x's dtype)
            x = x * torch.tensor(config.hidden_size**0.5, dtype=x.dtype)
        chunks.append(x)
    return chunks


class _Plan:
    """What `convert.convert` makes of each linear, as one object the layer loop asks."""

    def __init__(self, method, group_size, damp, select, on_layer, int8_gptq=True):
        self.method, self.group_size, self.damp = method, group_size, damp
        self.select, self.on_layer, self.int8_gptq = select, on_layer, int8_gptq

    def calibrated(self, calib_ids: list[int]) -> bool:
        """Whether the layers' Hessians (or AWQ's statistics) are collected: a calibration
        text long enough, and a quantizer that reads them."""
        needed = self.int8_gptq or self.method in ("gptq", "awq")
        return needed and len(calib_ids) >= MIN_CALIBRATION

    def twins(
        self, linears: dict, hessians, activations, on_layer, factors=None
    ) -> tuple[dict, dict]:
        """(INT8 twins, drafts) of `linears` by name, as `convert.convert` makes them.
        `factors`: the layer's GPTQ factors by use ("pairs", "int8", "draft": each a
        `SharedFactors` kept across the layer's linears, which share Hessian sums)."""
        factors = factors or {}
        method, G = self.method, self.group_size
        paired = {}
        if method == "gptq" and hessians is not None and self.damp == INT8_DAMP and self.int8_gptq:
            paired = gptq_pairs(
                linears, hessians, G, self.damp, self.select, on_layer, factors.get("pairs")
            )
        rounding = hessians if self.int8_gptq else None  # (None: to nearest)
        # (the draft reads the Hessians after the INT8 rounding only as unpaired GPTQ)
        release = not (method == "gptq" and not paired)
        made = {n: p[1] for n, p in paired.items()}
        int8 = int8_twins(linears, rounding, on_layer, made, release, factors.get("int8"))
        if method == UPPER:
            return int8, upper_drafts(int8, G or 64, self.select, on_layer)
        drafts = quantize_layers(linears, method, G, on_layer, hessians, self.select, self.damp,
                                 {n: p[0] for n, p in paired.items()}, activations,
                                 factors.get("draft"))  # fmt: skip
        return int8, drafts

    def layer(self, layer, prefix: str, streams: _Streams, rope) -> dict:
        """Run the streams through decoder `layer`, collecting what its quantizers need, and
        return its twins and report entries (`_write`); the draft stream runs on the twins."""
        linears = {prefix + n: m for n, m in layer.named_modules() if isinstance(m, Linear)}
        hessians = activations = None
        if streams.calib is not None:
            hooks = [HessianCollector(linears)]
            if self.method == "awq":
                hooks.append(ActivationCollector(linears))
            try:
                streams.calib.through(layer, rope)
            finally:
                for hook in hooks:
                    hook.close()
            hessians = hooks[0].hessians
            activations = hooks[1] if self.method == "awq" else None
        for stream in streams.fp():
            if stream is not streams.calib:
                stream.through(layer, rope)
        int8, drafts, errors = {}, {}, {}
        factors = _shared_factors()
        for name, linear in linears.items():  # (a linear at a time: its weight freed after)
            one = {name: linear}
            i8, d = self.twins(one, hessians, activations, self.on_layer, factors)
            int8 |= i8
            drafts |= d
            errors |= weight_errors(d, one)
            linear.int8, linear.draft = i8[name], d.get(name)
            linear.weight = nn.Parameter(linear.weight.to("meta"), False)  # (the twins run)
            _give_back()
        if streams.draft is not None:
            streams.draft.through(layer, rope)
        return {"int8": int8, "draft": drafts, "errors": errors}


def _shared_factors() -> dict[str, SharedFactors]:
    """`_Plan.twins`' factors: one `SharedFactors` per use, kept across the linears (or the
    head's row blocks) that share Hessian sums."""
    return {use: SharedFactors() for use in ("pairs", "int8", "draft")}


def _write(writer: TensorFileWriter, twins: dict, report: DraftReport) -> list[str]:
    """Append a layer's twins to draft.safetensors and its errors to the report; the names
    of its drafted linears."""
    for kind in ("draft", "int8"):
        for name, tensor in twin_tensors(twins[kind], kind).items():
            writer.add(name, tensor)
    report.rel_weight_error.update(twins["errors"])
    return list(twins["draft"])


class _Head:
    """lm_head: its input (the final norm of the streams), its twins made a row block at a
    time, and the report's logits."""

    def __init__(self, skeleton: Transformer, reader: CheckpointReader, plan: _Plan, streams):
        config = skeleton.config
        self.config, self.reader, self.plan, self.streams = config, reader, plan, streams
        self.weight = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        norm = skeleton.norm
        norm.load_state_dict({"weight": reader.get("norm.weight")}, assign=True)
        self.inputs = {id(s): [norm(x) for x in s.chunks] for s in (*streams.fp(), streams.draft)
                       if s is not None}  # fmt: skip
        self.target_logits = None

    def quantize(self) -> dict:
        V, H = self.reader.shapes[self.weight]
        plan, name = self.plan, "lm_head"
        rows = V if plan.method == "awq" else max(1, HEAD_BLOCK_BYTES // (4 * H))
        hessians = activations = None
        if self.streams.calib is not None:
            collect = HessianCollector({})
            for x in self.inputs[id(self.streams.calib)]:
                collect.add(name, x)
            hessians = collect.hessians
            if plan.method == "awq":
                activations = ActivationCollector({})
                for x in self.inputs[id(self.streams.calib)]:
                    activations.add(name, x)
        report = self.streams.report
        if report is not None:
            n = sum(x.shape[1] for x in self.inputs[id(report)])
            self.target_logits = torch.empty(n, V)
        joined, sq_err, sq_w = _Joined(V, rows >= V), 0.0, 0.0
        factors = _shared_factors()  # (every block reads the same Hessian: one factor)
        for start in range(0, V, rows):
            end = min(V, start + rows)
            block = Linear(H, end - start, bias=False, device="meta")
            block.weight = nn.Parameter(self.reader.rows(self.weight, start, end), False)
            # (a copy: the rounding releases what it reads, and every block reads H)
            block_h = None if hessians is None else dict(hessians)
            int8, drafts = plan.twins({name: block}, block_h, activations, None, factors)
            if report is not None:  # (the target's logits of these rows, as the head's)
                first = 0
                for x in self.inputs[id(report)]:  # x [1, t, hidden]
                    self.target_logits[first : first + x.shape[1], start:end] = block(x)[0]
                    first += x.shape[1]
            if name in drafts and rows >= V:
                errors = weight_errors(drafts, {name: block})
            elif name in drafts:
                w = block.weight.float()
                sq_err += float((drafts[name].effective_weight() - w).norm() ** 2)
                sq_w += float(w.norm() ** 2)
            joined.add(start, end, int8[name], drafts.get(name))
            del block, int8, drafts  # (the block's weight and twins: a block at a time)
            _give_back()
        if rows < V and sq_w:
            errors = {name: (sq_err / sq_w) ** 0.5}
        int8, draft = joined.int8, joined.draft
        for _ in range(1 + (draft is not None)):  # (`info.convert_steps`: INT8, then the draft)
            if plan.on_layer:
                plan.on_layer(name)
        self.head = Linear(H, V, bias=False, device="meta")
        self.head.int8, self.head.draft = int8, draft
        drafts = {} if draft is None else {name: draft}
        return {"int8": {name: int8}, "draft": drafts, "errors": errors if drafts else {}}

    def agreement(self) -> tuple[float, float]:
        """The report's top-1 agreement and mean KL over its positions: the draft's logits and
        their comparison REPORT_ROWS positions at a time."""
        cap = self.config.final_logit_softcapping
        same, kl, start = [], [], 0
        twin = self.head.draft  # (a 4-bit head: its CPU layout made once, not per chunk)
        if twin is not None:
            self.head.int8 = None  # (written already, and not the draft's: freed)
        layout = twin.cpu_layout() if twin is not None and twin.cpu_kernel_ok() else None
        for chunk in self.inputs[id(self.streams.draft)]:  # [1, t, hidden]
            for row in range(0, chunk.shape[1], REPORT_ROWS):  # (rows are independent)
                x = chunk[:, row : row + REPORT_ROWS]
                logits = self.head(x, DRAFT_W4) if layout is None else twin(x, layout)
                draft = logits[0].float()  # [rows, V]
                target = self.target_logits[start : start + draft.shape[0]]
                start += draft.shape[0]
                if cap is not None:
                    target, draft = soft_cap(target, cap), soft_cap(draft, cap)
                s, k = agreement_rows(target, draft)
                same.append(s)
                kl.append(k)
        return float(torch.cat(same).mean()), float(torch.cat(kl).mean())


def _give_back() -> None:
    """Return freed heap memory to the system (glibc's `malloc_trim`; nothing elsewhere). A
    layer's temporaries are many blocks of a few MB, which glibc keeps in its heap once freed
    (its mmap threshold rises to the largest block freed): without this, a 1B conversion's
    resident memory grew from 0.76 to 3.7 GB over its layers, with it stays at 0.76."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Joined:
    """lm_head's twins, filled a row block at a time: each block's rows copied into the whole
    twin's buffers (every buffer of Int8Linear and Int4Linear but AWQ's per-input scales and
    act-order's permutation is per output row: AWQ heads are one block, RTN/GPTQ never
    permute), so a block's twins are freed as soon as they are made."""

    def __init__(self, rows: int, whole: bool):
        self.rows, self.whole = rows, whole
        self.int8 = self.draft = None

    def add(self, start: int, end: int, int8: Int8Linear, draft: Int4Linear | None) -> None:
        if self.whole:
            self.int8, self.draft = int8, draft
            return
        if start == 0:
            self.int8 = Int8Linear(int8.in_features, self.rows, bias=False)
            if draft is not None:
                self.draft = Int4Linear(draft.in_features, self.rows, draft.group_size)
        for twin, part in ((self.int8, int8), (self.draft, draft)):
            if twin is None:
                continue
            whole = twin.state_dict()
            for key, tensor in part.state_dict().items():
                whole[key][start:end] = tensor
