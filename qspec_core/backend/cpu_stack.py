"""All decoder layers of a decode or verify step in one C++ call (`kernels/cpu/step.cpp`).

`stack_for(model, weights)` gives the `DecoderStack` that runs the layers on one weight set
(`Precision.weights`): the fp32 weights, the draft's 4-bit twins through the W4A8 kernel, or
the INT8 twins, exactly as `CpuBackend.linear` picks them (the KV view is the cache's part of
the call). It is built once per weight set and reused while everything it was built from is
unchanged: each call checks, by identity, every weight and twin it read (for a 30-layer model
like the default one: 480 checks for the full weights, 900 for the draft's and for the INT8
ones), and that no hooks are registered (with the earlier 1,530 checks this took about 0.25 ms
a forward on the 2-core dev VM, 1% of a draft step). None when the weights need what the C++
loop does not run: a 4-bit twin in a form other than plain W4A8 (AWQ scales, act-order), an
INT8 twin the CPU int8 kernel cannot take, weights not fp32, or hooks (calibration); the
backend then runs its Python loop. None too for a layer other than Llama's (`LayerSpec.native_ok`
false), which the backend does not serve anyway.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
from torch.nn.modules import module as _module_hooks

from kernels.cpu import build as cpu_ext
from kernels.cpu import linear as cpu_linear
from qspec_core.precision import INT8_WEIGHTS
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear

_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


@dataclass
class _Entry:
    stack: object | None  # the C++ DecoderStack, or None: the backend's Python loop runs
    checks: list = field(default_factory=list)  # (dict, key, object it held at build time)
    hooked: list = field(default_factory=list)  # modules whose hooks the Python loop would run

    def __post_init__(self):
        self._columns = None
        self._hook_dicts = None

    def current(self) -> bool:
        # (map/all iterate in C: about 0.1 us a check on the dev VM)
        if self._columns is None:
            self._columns = tuple(zip(*self.checks, strict=True)) or ((), (), ())
        dicts, keys, objs = self._columns
        return all(map(operator.is_, map(dict.get, dicts, keys), objs))

    def hooks(self) -> bool:
        if _module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks:
            return True
        if self._hook_dicts is None:
            # the modules' own hook dicts, gathered once: registering a hook adds to them in
            # place, so one truth test each sees it (3.5 us a forward against 22 us reading
            # them off the default model's 420 modules every time, on the 2-core Zen 5 VM)
            hooked = self.hooked
            self._hook_dicts = list(map(_FORWARD_HOOKS, hooked)) + list(map(_PRE_HOOKS, hooked))
        return any(self._hook_dicts)


# model -> {weights: _Entry}; beside the model rather than on it, so that copying or pickling a
# model never meets the C++ object
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_for(model, weights: str):
    """The DecoderStack for one weight set, or None (see the module docstring)."""
    stacks = _STACKS.setdefault(model, {})
    entry = stacks.get(weights)
    if entry is None or not entry.current():
        entry = stacks[weights] = _build(model, weights)
    if entry.stack is None or entry.hooks():
        return None
    return entry.stack


def forget(model) -> None:
    """Drop the built stacks (the model's tensors were replaced: `.to`, `.float`, ...)."""
    _STACKS.pop(model, None)


def _build(model, weights: str) -> _Entry:
    cfg = model.config
    ops = cpu_ext.load()
    entry = _Entry(None)
    if not cfg.layer.native_ok():  # the C++ layer is Llama's: pre-norm, no q/k norms
        return entry
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
            ok = _add_linear(stack, linear, weights, entry) and ok
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


def _add_linear(stack, linear, weights: str, entry: _Entry) -> bool:
    """Adds one `model.Linear` as `CpuBackend.linear` would run it on `weights`; False when
    the C++ loop cannot run it."""
    params, modules = linear._parameters, linear._modules
    weight, bias = params["weight"], params["bias"]
    entry.hooked.append(linear)
    # the twin `Linear.twin` picks (the draft's 4-bit twin, else its INT8 one; the INT8 sets'
    # INT8 twin): a change to any of the modules it reads rebuilds the stack
    twin = linear.twin(weights)
    entry.checks += [(modules, name, modules.get(name)) for name in TWIN_MODULES[weights]]
    if twin is not None:
        entry.hooked.append(twin)
    if isinstance(twin, Int4Linear):
        # the backend runs W4A8 on exactly these tensors (reset when they change)
        args = twin.w4a8_args()
        twin_bias = twin._buffers["bias"]
        entry.checks += [(twin.__dict__, "_w4a8", args), (twin._buffers, "bias", twin_bias)]
        if not args:
            return False
        stack.add_int4_linear(*args, twin_bias)
        return True
    if isinstance(twin, Int8Linear):
        names = ("weight_int8", "weight_scale", "bias")
        tensors = [twin._buffers[n] for n in names]
        entry.checks += [(twin._buffers, n, t) for n, t in zip(names, tensors, strict=True)]
        if not cpu_linear.int8_weight_ok(tensors[0]) or tensors[1].dtype != torch.float32:
            return False
        w8a8 = linear.int8_activations(weights)
        if w8a8 and tensors[0].shape[1] % cpu_linear.CHUNK:
            return False
        stack.add_int8_linear(*tensors, w8a8)  # (w8a8: activations rounded to int8)
        return True
    if twin is not None:
        return False  # a twin of another kind: its own forward, in the Python loop
    entry.checks += [(params, "weight", weight), (params, "bias", bias)]
    if not _fp32(weight) or (bias is not None and not _fp32(bias)):
        return False
    stack.add_linear(weight, bias)
    return True


# the `model.Linear` submodules `Linear.twin` reads per weight set
TWIN_MODULES = {"full": (), "int4": ("draft", "int8")} | dict.fromkeys(INT8_WEIGHTS, ("int8",))


def _fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
