"""All decoder layers of a decode or verify step in one C++ call (`kernels/cpu/step.cpp`).

`build_stack(model, weights, ext)` makes the `DecoderStack` that runs every layer on one weight
set (`Precision.weights`): the fp32 weights, the draft's 4-bit twins through the W4A8 kernel,
or the INT8 twins, as the kernel table (`kernel_table.py`) picks them for `CpuOps.linear` too
(the KV view is the cache's part of the call), with each layer's norms and kinds as the
family's `LayerSpec` sets them (placement, q/k norms, GeGLU, query scale, local RoPE; a
partial rotary through the cos/sin it is given). The stack holds the model's tensors
themselves, not copies (but for the bf16 copies of fp32 weights that hold bf16 numbers,
`layouts.py`, read only while the weight is unchanged, and Gemma's 1 + w norm weights): an
in-place change to a weight shows in the next step, and a tensor or twin *replaced* after the
build is not seen until the runner that owns the stack builds it again
(`CpuRunner.rebuild`; the runtime does so on `.to()`). None when the weights need what the C++
loop does not run: a 4-bit twin in a form other than plain W4A8 (AWQ scales, act-order), an
INT8 twin the CPU int8 kernel cannot take, weights not fp32 (or bf16-held,
`kernel_table.holds_bf16`); the runner then calls the model's
own layer loop with its ops.
"""

from __future__ import annotations

import torch

from kernels.cpu import linear as cpu_linear
from qspec_core.runner.kernel_table import step_kernel, weight_format


def build_stack(model, weights: str, ext, layouts=None):
    """The DecoderStack for one weight set, or None (see the module docstring). `ext`: the
    loaded C++ extension (`kernels.cpu.build.load()`); `layouts`: the runner's
    `WeightLayouts`, whose bf16 copies of bf16-valued fp32 weights the stack reads instead
    (`layouts.py`; None: the fp32 weights)."""
    cfg = model.config
    if not cfg.native_ok():
        return None
    stack = ext.DecoderStack(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    )
    bf16_rows = bool(getattr(ext, "BF16_WEIGHT_ROWS", False))
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
            if not _add_linear(stack, linear, weights, layouts, bf16_rows):
                return None
        norms = _layer_norms(layer)
        present = [n for n in norms.values() if n is not None]
        if not all(_fp32(n.weight) and n.eps == cfg.rms_norm_eps for n in present):
            return None
        weight = {name: None if n is None else norm_weight(n) for name, n in norms.items()}
        stack.add_layer(
            **weight,
            qk_per_head=attn.qk_norm == "head",
            q_scale=attn.q_scale or 1.0,
            gelu_tanh=cfg.layer.activation == "gelu_pytorch_tanh",
            local_rope=layer.local,
        )
    return stack


def _layer_norms(layer) -> dict:
    """A decoder layer's norms by the stack's names (`step.cpp` `Layer`), None where its
    placement has none."""
    attn = layer.self_attn
    return {
        "input_norm": getattr(layer, "input_layernorm", None),
        "post_norm": layer.post_attention_layernorm,
        "pre_ff_norm": getattr(layer, "pre_feedforward_layernorm", None),
        "post_ff_norm": getattr(layer, "post_feedforward_layernorm", None),
        "q_norm": getattr(attn, "q_norm", None),
        "k_norm": getattr(attn, "k_norm", None),
    }


def norm_weight(norm) -> torch.Tensor:
    """The fp32 weight the C++ RMSNorm scales by for `norm` (a `model.RMSNorm`): its own
    weight, or, scaling by 1 + weight (Gemma), that sum, computed as the PyTorch norm computes
    it. (A sum is a copy: a later in-place change to the weight needs `CpuRunner.rebuild`.)"""
    if norm.kind == "rms_plus_one":
        return 1.0 + norm.weight.float()
    return norm.weight  # ("rms" and "rms_fp32" are one computation in fp32)


def _add_linear(stack, linear, weights: str, layouts=None, bf16_rows=False) -> bool:
    """Adds one `model.Linear` with the step kernel `kernel_table` chooses for it (the one
    `CpuOps.linear` runs); False when the C++ loop cannot run it: no stack kernel for the
    format, or tensors the C++ does not take. `bf16_rows`: the extension reads bf16 weights
    for their upcast's bits (`BF16_WEIGHT_ROWS`), so it takes a bf16-held weight
    (`kernel_table.holds_bf16`)."""
    twin = linear.twin(weights)
    fmt = weight_format(linear, weights, twin)
    add = step_kernel(fmt).stack
    if add == "add_int4_linear":
        stack.add_int4_linear(*twin.w4a8_args(), twin.bias)  # (packed, scale, zero, G), bias
        return True
    if add == "add_int8_linear":
        tensors = (twin.weight_int8, twin.weight_scale, twin.bias)
        if not cpu_linear.int8_weight_ok(tensors[0]) or tensors[1].dtype != torch.float32:
            return False
        w8a8 = fmt == "w8a8"  # (activations rounded to int8 per 64 inputs)
        if w8a8 and tensors[0].shape[1] % cpu_linear.CHUNK:
            return False
        stack.add_int8_linear(*tensors, w8a8)
        return True
    if add == "add_linear":
        weight, bias = linear.weight, linear.bias
        held = bf16_rows and _cpu(weight, torch.bfloat16)  # (a bf16-held weight: read as is)
        if not (held or _fp32(weight)) or (bias is not None and not _fp32(bias)):
            return False
        # (the stack reads the copy while the weight's version is the one copied: step.cpp)
        stack.add_linear(weight, bias, layouts.bf16(linear) if layouts is not None else None)
        return True
    return False  # (add is None: the twin's own forward, in the model's loop)


def _fp32(t: torch.Tensor) -> bool:
    return _cpu(t, torch.float32)


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
