"""The CPU backend: a model's forward through qspec's C++ kernels (`kernels/cpu/`).

Three things, chosen here and nowhere else:

- a decode or verify step (at most `MAX_ROWS` = gamma + 1 <= 17 rows) in fp32 runs every
  decoder layer in one C++ call (`DecoderStack`, built per weight set by `cpu_stack.py`) when
  the cache offers a `step_plan` (what the stack reads of it: `FullStep`, `HierStep`);
- otherwise the layers run in the Python loop below: the same math as
  `model/transformer.py`, with RMSNorm, the residual add and RoPE in C++ when fp32
  (`kernels/cpu/decode.cpp`), and no `nn.Module.__call__` bookkeeping (a few microseconds,
  211 times a step) unless hooks are registered (calibration registers them on linears);
- every linear of a step runs a batch-invariant few-row kernel (`kernels/cpu/linear.cpp`,
  and `int_dot.cpp` for the int8-activation sets "w8a8" and the draft's "int4"):
  a row's result does not depend on how many rows share the call, so a token's logits inside
  a verify are bit for bit those of the same token decoded alone, in every dtype and weight
  set (greedy QuantSpec == target-ar rests on it). Longer inputs (prefill) run PyTorch's GEMM,
  or the quantized twin's own forward.

`tests/test_cpu_step.py` holds the C++ stack to the Python loop's bits, and
`tests/test_cpu_decode.py` both to the plain PyTorch model.

A family whose layer the C++ kernels do not compute (`LayerSpec.native_ok()` false: q/k norms,
post-norms) is not served: its model runs its own plain PyTorch forward, on PyTorch's GEMM.

Two more cases run the plain PyTorch math instead, so the batch invariance above does not hold
for them: a forward with autograd on (`serves`: the engine always runs under inference mode),
and a linear or norm with forward hooks registered (the module call runs them; GPTQ and AWQ
calibration hooks every linear, over prefill-sized chunks that take PyTorch's GEMM anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module_hooks

from kernels.cpu import build
from kernels.cpu import linear as rows_kernels
from kernels.formats import quantize_activations
from qspec_core.backend import cpu_stack
from qspec_core.cache.protocol import FullStep, HierStep
from qspec_core.precision import Precision
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear
from qspec_core.quant.prefill_choice import prefill_path

MAX_ROWS = rows_kernels.MAX_ROWS


def _hooked(module) -> bool:
    return bool(
        _module_hooks._global_forward_hooks
        or _module_hooks._global_forward_pre_hooks
        or module._forward_hooks
        or module._forward_pre_hooks
    )


class CpuBackend:
    """Runs `Transformer.forward` on CPU (see the module docstring). Stateless but for the
    built C++ stacks, which `cpu_stack` keeps beside each model; one instance serves all."""

    name = "cpu"

    def serves(self, model, tokens: torch.Tensor) -> bool:
        """Whether this backend runs `model`'s forward on `tokens` (see the module docstring)."""
        return (
            tokens.device.type == "cpu"
            and not torch.is_grad_enabled()
            and model.config.layer.native_ok()
        )

    def forward(self, model, tokens, input_pos, cache, path: Precision, last_only: bool):
        x = model.embed_tokens(tokens)
        cos, sin = model.rotary_emb(input_pos, x.dtype)
        B, T = tokens.shape
        plan = stack = None
        if B * T <= MAX_ROWS and x.dtype == torch.float32:
            stack = cpu_stack.stack_for(model, path.weights)
            step_plan = getattr(cache, "step_plan", None)
            if stack is not None and step_plan is not None:
                plan = step_plan(input_pos, path, T)  # the cache's bookkeeping, all layers
        if isinstance(plan, HierStep):
            p = plan
            x = stack.run_hier(
                x, cos, sin, p.buffers, p.lo, p.hi, p.n_quant, p.n_quant_q, p.shift,
                p.input_pos, p.int8, p.int_queries, p.group_size, p.chunk_size,
            )  # fmt: skip
        elif isinstance(plan, FullStep):
            p = plan
            x = stack.run_full(x, cos, sin, p.k, p.v, p.start, p.end, p.mask, p.is_causal)
        else:
            x = self._layers(model, x, cos, sin, input_pos, cache, path)
        if last_only:
            x = x[:, -1:]
        return self.linear(model.lm_head, self.norm(model.norm, x), path)

    def _layers(self, model, x, cos, sin, input_pos, cache, path):
        """`DecoderLayer.forward` for every layer, with the C++ ops where fp32."""
        ops = build.load()
        B, T, _ = x.shape
        fast = x.dtype == torch.float32 and cos.dtype == torch.float32
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            h = self.norm(layer.input_layernorm, x)
            q = self.linear(attn.q_proj, h, path).view(B, T, attn.n_heads, attn.head_dim)
            k = self.linear(attn.k_proj, h, path).view(B, T, attn.n_kv_heads, attn.head_dim)
            v = self.linear(attn.v_proj, h, path).view(B, T, attn.n_kv_heads, attn.head_dim)
            if fast and q.dtype == torch.float32 and k.dtype == torch.float32:
                ops.rope_cpu(q, cos, sin)  # in place, on the projections' fresh outputs
                ops.rope_cpu(k, cos, sin)
                q, k = q.transpose(1, 2), k.transpose(1, 2)
            else:
                rotate = model.rotary_emb.rotate  # (the backend imports nothing of the model)
                q = rotate(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
                k = rotate(k.transpose(1, 2), cos, sin)  # [B, n_kv, T, D]
            out = cache.attend(attn.layer_idx, q, k, v.transpose(1, 2), input_pos, path)
            h = self.linear(attn.o_proj, out.transpose(1, 2).reshape(B, T, -1), path)
            norm = layer.post_attention_layernorm
            if fast and h.dtype == torch.float32 and not _hooked(norm):
                y = ops.add_rms_norm_cpu(x, h, norm.weight, norm.eps)  # x += h, in place
            else:
                x = x + h
                y = self.norm(norm, x)
            up = self.linear(mlp.up_proj, y, path)
            gate = F.silu(self.linear(mlp.gate_proj, y, path))
            x = x + self.linear(mlp.down_proj, gate.mul_(up), path)
        return x

    def norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.is_contiguous() and not _hooked(norm):
            return build.load().rms_norm_cpu(x, norm.weight, norm.eps)
        return norm(x)

    def linear(self, layer, x: torch.Tensor, path: Precision) -> torch.Tensor:
        """`layer(x, path)` (a `model.Linear`) through the batch-invariant row kernels when x
        has at most MAX_ROWS rows, else PyTorch's GEMM or the twin's own forward."""
        twin = layer.twin(path.weights)
        if _hooked(layer) or (twin is not None and _hooked(twin)):
            return layer(x, path)  # the module call runs the hooks
        if twin is None:
            params = layer._parameters
            weight, bias = params["weight"], params["bias"]
            if rows_kernels.usable(x, weight):
                return rows_kernels.linear(x, weight, bias)
            return F.linear(x, weight, bias)
        buffers = twin._buffers
        if isinstance(twin, Int8Linear):
            w8a8 = layer.int8_activations(path.weights)
            usable = rows_kernels.w8a8_usable if w8a8 else rows_kernels.int8_usable
            run = rows_kernels.w8a8_linear if w8a8 else rows_kernels.int8_linear
            w, bias = buffers["weight_int8"], buffers["bias"]
            if usable(x, w):
                # (a model cast with .to(bf16) casts the scale too: the kernels take fp32)
                return run(x, w, buffers["weight_scale"].float().contiguous(), bias)
            # a prefill: the same kernels a slice of rows at a time where this machine
            # measured them fastest (then the prompt's rows are bit for bit a decode's)
            if prefill_path() == "rows" and usable(x[..., :1, :], w):
                scale = buffers["weight_scale"].float().contiguous()
                if w8a8:  # (one call: the C++ schedules many rows as a GEMM, same bits)
                    return run(x, w, scale, bias)
                return rows_kernels.in_slices(run, x, w, scale, bias)
            if w8a8:  # (prefill: the same rounding, then the twin's own kernel)
                return twin.forward(quantize_activations(x).to(x.dtype))
        elif isinstance(twin, Int4Linear):
            args = twin.w4a8_args()
            if args and rows_kernels.int4_usable(x, twin.in_features, twin.group_size):
                return rows_kernels.int4_linear(x, *args, bias=buffers["bias"])  # W4A8
        return twin.forward(x)

    def __deepcopy__(self, memo):
        return self  # one backend serves every model (and copies of models)

    def __reduce__(self):
        return (_cpu_backend, ())


def _cpu_backend() -> CpuBackend:
    return CPU_BACKEND


CPU_BACKEND = CpuBackend()
