"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2) in plain PyTorch.

Module and parameter names follow Hugging Face, so a checkpoint loads by stripping the
`model.` prefix. The call is explicit: `model(tokens, input_pos, cache, path)`; attention
goes through `cache.attend`, which owns K/V storage and the view the `path` reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_hooks

from kernels.cpu import build as cpu_ext

from kernels.cpu import linear as cpu_linear
from qspec_core.backend import cpu_stack as cpu_step
from qspec_core.config import ModelConfig
from qspec_core.cache.full import KVCache
from qspec_core.model.rope import RotaryEmbedding, apply_rotary

# Paths that run on the 4-bit draft weights. "draft-kv4" (full-precision weights over the INT4
# KV view) is the bench's ablation of the draft's two ingredients; see `kv_cache.PATHS`.
DRAFT_WEIGHT_PATHS = ("draft",)


TARGET_WEIGHTS = ("full", "int8")


class Linear(nn.Linear):
    """nn.Linear with an optional 4-bit twin (`draft`) that the draft path uses instead, and
    an optional INT8 twin (`int8`) that every other path uses once `set_target_weights`
    selects it (Quasar's quantized verifier)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft: nn.Module | None = None  # set by `attach_draft`; then a submodule
        self.int8: nn.Module | None = None  # set by `attach_int8`
        self.use_int8 = False

    def forward(self, x: torch.Tensor, path: str = "fp") -> torch.Tensor:
        # (submodules and parameters read from their dicts: nn.Module.__getattr__ is slow, and
        # a decode step makes 211 of these calls)
        if path in DRAFT_WEIGHT_PATHS:
            draft = self._modules.get("draft")
            if draft is not None:
                return draft(x)
        if self.use_int8:
            return self._modules["int8"](x)
        weight = self._parameters["weight"]
        if cpu_linear.usable(x, weight):  # a decode or verify step on CPU, fp32
            return cpu_linear.linear(x, weight, self._parameters["bias"])
        return super().forward(x)


def _fast(x: torch.Tensor) -> bool:
    """Whether the C++ CPU ops (`kernels/cpu/decode.cpp`) serve x: fp32 on CPU, outside
    autograd. Their eager twins are the code paths below each call."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and x.is_contiguous()
        and cpu_ext.available()
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fast(x):
            return cpu_ext.load().rms_norm_cpu(x, self.weight, self.eps)
        # Normalize in fp32, cast back, then scale: the order HF uses, so bf16 results agree.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_bias = config.attention_bias or config.qkv_bias
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_dim, bias=qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_dim, bias=qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_dim, bias=qkv_bias)
        self.o_proj = Linear(q_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, x, cos, sin, input_pos, cache: KVCache, path: str) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x, path).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x, path).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x, path).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if _fast(q) and _fast(k) and cos.dtype == torch.float32:
            ops = cpu_ext.load()
            ops.rope_cpu(q, cos, sin)  # in place, on the projections' fresh outputs
            ops.rope_cpu(k, cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
            k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, n_kv, T, D]
        out = cache.attend(self.layer_idx, q, k, v, input_pos, path)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1), path)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor, path: str = "fp") -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, path)) * self.up_proj(x, path), path)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, input_pos, cache, path):
        h = self.self_attn(self.input_layernorm(x), cos, sin, input_pos, cache, path)
        if _fast(x) and _fast(h):  # x += h and the second norm in one call
            norm = self.post_attention_layernorm
            y = cpu_ext.load().add_rms_norm_cpu(x, h, norm.weight, norm.eps)
            return x.add_(self.mlp(y, path))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), path)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _apply(self, fn, *args, **kwargs):
        cpu_step.forget(self)  # .to(), .float(): the built stacks point at the old tensors
        return super()._apply(fn, *args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        cache: KVCache,
        path: str = "fp",
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens [B, T] at positions input_pos [T] -> logits [B, T, V] (or [B, 1, V]).

        `path` selects the weights and KV view: "fp" (full precision, the baseline),
        "target" and "draft" (QuantSpec's two paths over one hierarchical cache), "draft-kv4"
        (full weights over the INT4 view, an ablation). The draft path uses each linear's
        4-bit twin when the model has one (`attach_draft`).
        `last_only` skips the vocabulary projection for all but the last position (prefill).
        """
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary_emb(input_pos, x.dtype)
        if x.shape[0] * x.shape[1] <= cpu_linear.MAX_ROWS and _fast(x):
            x = self._decode_layers(x, cos, sin, input_pos, cache, path)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, input_pos, cache, path)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x), path)

    def _decode_layers(self, x, cos, sin, input_pos, cache, path):
        """The layers of a decode or verify step on CPU in fp32: in one C++ call
        (`qspec_core/cpu_step.py`) when the path's weights and the cache allow; else
        `DecoderLayer.forward`'s math with the C++ ops of `kernels/cpu/decode.cpp`, minus the
        ~20 Python module calls per layer around them (linears run their own forward; hooks,
        if any, are honoured). `tests/test_cpu_step.py` holds the two to the same bits, and
        `test_model_steps_equal_the_eager_model` both to the eager model.
        """
        stack = cpu_step.stack_for(self, path)
        step = getattr(cache, "cpu_step", None)
        run = step(input_pos, path, x.shape[1]) if stack is not None and step else None
        if run is not None:
            return run(stack, x, cos, sin)
        ops = cpu_ext.load()
        B, T, _ = x.shape
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            h = ops.rms_norm_cpu(x, norm1.weight, norm1.eps)
            q = _call(attn.q_proj, h, path).view(B, T, attn.n_heads, attn.head_dim)
            k = _call(attn.k_proj, h, path).view(B, T, attn.n_kv_heads, attn.head_dim)
            v = _call(attn.v_proj, h, path).view(B, T, attn.n_kv_heads, attn.head_dim)
            ops.rope_cpu(q, cos, sin)  # in place, on the projections' fresh outputs
            ops.rope_cpu(k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = cache.attend(attn.layer_idx, q, k, v, input_pos, path)  # [B, H, T, D]
            h = _call(attn.o_proj, out.transpose(1, 2).reshape(B, T, -1), path)
            y = ops.add_rms_norm_cpu(x, h, norm2.weight, norm2.eps)  # x += h
            up = _call(mlp.up_proj, y, path)
            x.add_(_call(mlp.down_proj, F.silu(_call(mlp.gate_proj, y, path)).mul_(up), path))
        return x


def _call(layer: Linear, x: torch.Tensor, path: str) -> torch.Tensor:
    """layer(x, path) without nn.Module.__call__'s bookkeeping (a few microseconds, 211 times
    a step), unless hooks are registered on the layer or its twin (calibration uses them)."""
    twin = layer._modules.get("draft") if path in DRAFT_WEIGHT_PATHS else None
    if twin is None and layer.use_int8:
        twin = layer._modules["int8"]
    if _module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks:
        return layer(x, path)
    for m in (layer, twin):
        if m is not None and (m._forward_hooks or m._forward_pre_hooks):
            return layer(x, path)
    if twin is not None:
        return twin.forward(x)
    return layer.forward(x, path)


def linear_layers(model: Transformer) -> dict[str, Linear]:
    """Every linear layer by its HF name ("layers.0.self_attn.q_proj", ..., "lm_head")."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def attach_draft(model: Transformer, drafts: dict[str, nn.Module]) -> None:
    """Give the named linear layers their 4-bit twins (the draft path's weights)."""
    layers = linear_layers(model)
    unknown = drafts.keys() - layers.keys()
    if unknown:
        raise KeyError(f"no such linear layers: {sorted(unknown)[:4]}")
    for name, draft in drafts.items():
        layers[name].draft = draft  # registered as a submodule: `<name>.draft.packed`, ...


def has_draft(model: Transformer) -> bool:
    """Whether the model carries 4-bit draft weights (a `qspec convert` folder)."""
    return any(layer.draft is not None for layer in linear_layers(model).values())


def attach_int8(model: Transformer, layers: dict[str, nn.Module]) -> None:
    """Give the named linear layers their INT8 twins (the INT8-weight target's weights)."""
    own = linear_layers(model)
    unknown = layers.keys() - own.keys()
    if unknown:
        raise KeyError(f"no such linear layers: {sorted(unknown)[:4]}")
    for name, layer in layers.items():
        own[name].int8 = layer


def has_int8(model: Transformer) -> bool:
    return any(layer.int8 is not None for layer in linear_layers(model).values())


def set_target_weights(model: Transformer, kind: str) -> None:
    """Which weights every non-draft path runs on: "full" (the checkpoint) or "int8"."""
    if kind not in TARGET_WEIGHTS:
        raise ValueError(f"target weights must be one of {TARGET_WEIGHTS}, not {kind!r}")
    for layer in linear_layers(model).values():
        if kind == "int8" and layer.int8 is None:
            raise ValueError("the model has no INT8 weights (attach_int8)")
        layer.use_int8 = kind == "int8"


def target_weights(model: Transformer) -> str:
    return "int8" if any(m.use_int8 for m in linear_layers(model).values()) else "full"
