"""All decoder layers of a decode or verify step in one C++ call (`kernels/cpu/step.cpp`).

`stack_for(model, path)` gives the `DecoderStack` that runs `path`'s layers: the fp32 weights,
the draft's 4-bit twins through the W4A8 kernel, or the INT8 target twins, exactly as
`Transformer._decode_layers` picks them. It is built once per path and reused while
everything it was built from is unchanged: each call checks, by identity, every weight, twin
and flag it read (1,530 for the default model's draft), and that no hooks are registered:
0.25 ms a forward on the 2-core dev VM, about 1% of a draft step. None when the path needs
what the C++ loop does not run: a 4-bit twin in a form other than plain W4A8 (AWQ scales,
act-order), an INT8 twin the CPU int8 kernel cannot take, weights not fp32, or hooks
(calibration); the model then runs its Python layer loop.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
from torch.nn.modules import module as _module_hooks

from kernels.cpu import build as cpu_ext
from qspec_core.quant.int8 import Int8Linear
from qspec_core.quant.int4 import Int4Linear

_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


@dataclass
class _Entry:
    stack: object | None  # the C++ DecoderStack, or None: this path runs in Python
    checks: list = field(default_factory=list)  # (dict, key, object it held at build time)
    hooked: list = field(default_factory=list)  # modules whose hooks the Python loop would run

    def __post_init__(self):
        self._columns = None

    def current(self) -> bool:
        # (map/all iterate in C: about 0.1 us a check on the dev VM)
        if self._columns is None:
            self._columns = tuple(zip(*self.checks, strict=True)) or ((), (), ())
        dicts, keys, objs = self._columns
        return all(map(operator.is_, map(dict.get, dicts, keys), objs))

    def hooks(self) -> bool:
        if _module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks:
            return True
        return any(map(_FORWARD_HOOKS, self.hooked)) or any(map(_PRE_HOOKS, self.hooked))


# model -> {path: _Entry}; beside the model rather than on it, so that copying or pickling a
# model never meets the C++ object
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_for(model, path: str):
    """The DecoderStack for `path`'s weights, or None (see the module docstring)."""
    stacks = _STACKS.setdefault(model, {})
    entry = stacks.get(path)
    if entry is None or not entry.current():
        entry = stacks[path] = _build(model, path)
    if entry.stack is None or entry.hooks():
        return None
    return entry.stack


def forget(model) -> None:
    """Drop the built stacks (the model's tensors were replaced: `.to`, `.float`, ...)."""
    _STACKS.pop(model, None)


def _build(model, path: str) -> _Entry:
    from qspec_core.model.transformer import DRAFT_WEIGHT_PATHS

    cfg = model.config
    ops = cpu_ext.load()
    entry = _Entry(None)
    stack = ops.DecoderStack(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    )
    ok = True
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        ):
            ok = _add_linear(stack, linear, path in DRAFT_WEIGHT_PATHS, entry) and ok
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        for norm in norms:
            weight = norm._parameters["weight"]
            entry.checks.append((norm._parameters, "weight", weight))
            ok = ok and _fp32(weight) and norm.eps == cfg.rms_norm_eps
        if ok:
            stack.add_layer(norms[0].weight, norms[1].weight)
    if ok:
        entry.stack = stack
    return entry


def _add_linear(stack, linear, draft_path: bool, entry: _Entry) -> bool:
    """Adds one `model.Linear` as `Linear.forward` would run it for the path; False when the
    C++ loop cannot run it."""
    params, modules = linear._parameters, linear._modules
    weight, bias, draft = params["weight"], params["bias"], modules.get("draft")
    entry.checks += [
        (params, "weight", weight),
        (params, "bias", bias),
        (modules, "draft", draft),
        (modules, "int8", modules.get("int8")),
        (linear.__dict__, "use_int8", linear.use_int8),
    ]
    entry.hooked.append(linear)
    if draft_path and draft is not None:
        entry.hooked.append(draft)
        if not isinstance(draft, Int4Linear):
            return False
        # the twin's forward runs W4A8 on exactly these tensors (reset when they change)
        args = draft.__dict__["_w4a8"]
        if args is None:
            args = draft._w4a8 = draft._w4a8_args()
        twin_bias = draft._buffers["bias"]
        entry.checks += [(draft.__dict__, "_w4a8", args), (draft._buffers, "bias", twin_bias)]
        if not args:
            return False
        stack.add_int4_linear(*args, twin_bias)
        return True
    if linear.use_int8:
        int8 = modules["int8"]
        entry.hooked.append(int8)
        if not isinstance(int8, Int8Linear):
            return False
        names = ("weight_int8", "weight_scale", "bias")
        tensors = [int8._buffers[n] for n in names]
        entry.checks += [(int8._buffers, n, t) for n, t in zip(names, tensors, strict=True)]
        if not int8.rows_kernel_ok() or tensors[1].dtype != torch.float32:
            return False
        stack.add_int8_linear(*tensors)
        return True
    if not _fp32(weight) or (bias is not None and not _fp32(bias)):
        return False
    stack.add_linear(weight, bias)
    return True


def _fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
