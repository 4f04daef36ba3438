"""The decoder of every supported family in plain PyTorch, its layers built from the family's
`LayerSpec` (`config.layer`, `qspec_core/families/`): Llama's pre-norm layer, with the
biases, q/k norms and norm placement a family declares.

Module and parameter names follow Hugging Face, so a checkpoint loads by stripping the
`model.` prefix. The call is explicit: `model(tokens, input_pos, cache, path, ops=...)`, where
`path` (`qspec_core.precision.Precision`) names the weights each linear uses and the KV view
the cache's attention reads; attention goes through `cache.attend`, which owns K/V storage.

This file is the math only: a plain `nn.Module` that runs as is on any device and knows no
runner. What runs it fast is chosen above it, at load (`qspec_core/runner/`): a runner calls
this forward with its own `ops` (`model/ops.py`: the kernels of the linears, norms and RoPE;
default PyTorch's), or, for a decode step, runs every layer in its native stack between
`embed` and `head`. Called directly, the model is the PyTorch reference (what calibration
runs, with its hooks), and the tests hold every runner to it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.formats import ACT_CHUNK, quantize_activations
from kernels.reference import soft_cap
from qspec_core.cache.protocol import KVCache
from qspec_core.config import ModelConfig
from qspec_core.model.ops import TORCH_OPS, LayerOps
from qspec_core.model.rope import RotaryEmbedding
from qspec_core.precision import FP, INT8_WEIGHTS, Precision


class Linear(nn.Linear):
    """nn.Linear with optional quantized twins, one per weight set of `Precision.weights`:
    `draft` (4-bit, "int4") and `int8` ("int8", and "w8a8" with int8 activations). "full" is
    the layer's own weight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft: nn.Module | None = None  # set by `attach_draft`; then a submodule
        self.int8: nn.Module | None = None  # set by `attach_int8`

    def twin(self, weights: str) -> nn.Module | None:
        """The module that runs `weights` for this layer; None: the layer's own weight.

        A layer without a 4-bit twin (a recipe that keeps attention or lm_head out of the
        4-bit draft, or an imported checkpoint that left lm_head unquantized) drafts on its
        INT8 twin, which the verifier holds anyway: no second copy, a quarter of the full
        weight's bytes; without one, on its own weight. Every layer has its INT8 twin once
        `attach_int8` ran."""
        if weights == "int4":
            draft = self._modules.get("draft")  # (dict reads: nn.Module.__getattr__ is slow)
            return draft if draft is not None else self._modules.get("int8")
        if weights in INT8_WEIGHTS:
            return self._modules["int8"]
        return None

    def int8_activations(self, weights: str) -> bool:
        """Whether `weights` runs this layer as W8A8 (int8 activations per 64 inputs): the
        "w8a8" set, and a draft on the INT8 twin when the inputs come in whole 64-chunks (the
        draft's other linears round their activations too: W4A8)."""
        if weights == "w8a8":
            return True
        return (
            weights == "int4"
            and self._modules.get("draft") is None
            and self._modules.get("int8") is not None
            and self.in_features % ACT_CHUNK == 0
        )

    def forward(self, x: torch.Tensor, path: Precision = FP) -> torch.Tensor:
        twin = self.twin(path.weights)
        if twin is not None:
            if self.int8_activations(path.weights):
                return twin(quantize_activations(x).to(x.dtype))
            return twin(x)
        return F.linear(x, held_weight(self, x.dtype), self.bias)


def held_weight(layer: nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """`layer.weight` in `dtype`: itself, or a bf16-held weight (`build_model`) upcast, exactly
    (a transient copy: one layer's weight at a time). Whole, not in blocks of rows: the same
    fp32 GEMM on the same shapes gives fp32-held weights' bits, where blocks of output rows
    changed some (measured on Llama-3.2-1B's shapes) and ran no faster."""
    weight = layer._parameters["weight"]  # (dict reads: nn.Module.__getattr__ is slow)
    return weight if weight.dtype == dtype else weight.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kind: str = "rms"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kind = kind  # LayerSpec.norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, then cast and scale (Llama), or scale and cast (OLMo 2, Gemma's
        # 1 + weight): each family's order, so bf16 results agree with HF's.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms":
            return self.weight * x.to(dtype)
        if self.kind == "rms_plus_one":
            return (x * (1.0 + self.weight.float())).to(dtype)
        return (self.weight.float() * x).to(dtype)


def _norm(config: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, config.layer.norm)


def _embedding(vocab: int, dim: int) -> nn.Embedding:
    """nn.Embedding(vocab, dim), drawn N(0, 1) as torch draws it, except on the meta device
    (`build_model`'s skeleton), where it draws nothing: torch's normal_ on a meta tensor
    imports torch._dynamo, and Triton with it (150 MB resident on a CPU run)."""
    weight = torch.empty(vocab, dim)  # (on the meta device under `with torch.device("meta")`)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(vocab, dim, _weight=weight)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        spec = config.layer
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_dim, bias=spec.qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_dim, bias=spec.qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_dim, bias=spec.qkv_bias)
        self.o_proj = Linear(q_dim, config.hidden_size, bias=spec.o_bias)
        # q/k norms before RoPE: over each head (Qwen3) or the whole projection (OLMo 2)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm is not None:
            per_head = spec.qk_norm == "head"
            self.q_norm = _norm(config, self.head_dim if per_head else q_dim)
            self.k_norm = _norm(config, self.head_dim if per_head else kv_dim)
        # the cache's attention scales by head_dim ** -0.5; Gemma's by query_pre_attn_scalar's
        self.q_scale = None
        scalar = config.query_pre_attn_scalar
        if scalar is not None and scalar != self.head_dim:
            self.q_scale = math.sqrt(self.head_dim / scalar)

    def forward(
        self, x, cos, sin, input_pos, cache: KVCache, path: Precision, ops: LayerOps = TORCH_OPS
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # [B, T, H * D], [B, T, n_kv * D] twice
        q, k, v = ops.linears((self.q_proj, self.k_proj, self.v_proj), x, path)
        if self.qk_norm == "all":
            q, k = ops.norm(self.q_norm, q), ops.norm(self.k_norm, k)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = ops.norm(self.q_norm, q), ops.norm(self.k_norm, k)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q = ops.rope(q, cos, sin)  # [B, H, T, D]
        k = ops.rope(k, cos, sin)  # [B, n_kv, T, D]
        if self.q_scale is not None:
            q = q * self.q_scale
        out = cache.attend(self.layer_idx, q, k, v.transpose(1, 2), input_pos, path)  # [B,H,T,D]
        return ops.linear(self.o_proj, out.transpose(1, 2).reshape(B, T, -1), path)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.layer.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

        self.act = ACTIVATIONS[config.layer.activation]

    def forward(self, x: torch.Tensor, path: Precision = FP, ops: LayerOps = TORCH_OPS):
        gate, up = ops.linears((self.gate_proj, self.up_proj), x, path)  # [B, T, I] each
        return ops.linear(self.down_proj, ops.act_mul(self.act, gate, up), path)


class DecoderLayer(nn.Module):
    """Attention then MLP, each in a residual branch; the norms where `config.layer` puts them
    (HF names: pre-norm input_layernorm, post_attention_layernorm; post-norm
    post_attention_layernorm, post_feedforward_layernorm; sandwich all four)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.placement = placement = config.layer.norm_placement
        # whether this layer rotates with the model's local RoPE (Gemma 3's sliding layers)
        self.local = config.layer.local_rope and (
            config.layer_types[layer_idx] == "sliding_attention"
        )
        h = config.hidden_size
        if placement in ("pre", "sandwich"):
            self.input_layernorm = _norm(config, h)
        self.post_attention_layernorm = _norm(config, h)  # (pre-norm: the MLP's input norm)
        if placement == "sandwich":
            self.pre_feedforward_layernorm = _norm(config, h)
        if placement in ("post", "sandwich"):
            self.post_feedforward_layernorm = _norm(config, h)

    def forward(self, x, cos, sin, input_pos, cache, path, ops: LayerOps = TORCH_OPS):
        """x [B, T, hidden] -> [B, T, hidden]; `ops` may update x in place (`ops.add_norm`)."""
        rest = (cos, sin, input_pos, cache, path, ops)  # the attention's arguments after x
        if self.placement == "pre":
            h = self.self_attn(ops.norm(self.input_layernorm, x), *rest)
            x, y = ops.add_norm(x, h, self.post_attention_layernorm)
            return x + self.mlp(y, path, ops)
        if self.placement == "post":
            h = self.self_attn(x, *rest)
            x = x + ops.norm(self.post_attention_layernorm, h)
            return x + ops.norm(self.post_feedforward_layernorm, self.mlp(x, path, ops))
        h = self.self_attn(ops.norm(self.input_layernorm, x), *rest)
        x = x + ops.norm(self.post_attention_layernorm, h)
        h = self.mlp(ops.norm(self.pre_feedforward_layernorm, x), path, ops)
        return x + ops.norm(self.post_feedforward_layernorm, h)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
        if config.layer.local_rope:
            self.local_rotary_emb = RotaryEmbedding(local_rope_config(config))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

        self.weight_sets = {"full"}  # Precision.weights this model can run (attach_* add)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # (the embedding table may be narrower: `embed`)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        cache: KVCache,
        path: Precision = FP,
        last_only: bool = False,
        ops: LayerOps = TORCH_OPS,
        head: Linear | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] at positions input_pos [T] -> logits [B, T, V] (or [B, 1, V]).

        `path` picks the weights (full, int8, int4: each linear's twin) and the KV view the
        cache reads (fp, int8, int4). `last_only` skips the vocabulary projection for all but
        the last position (prefill). `ops` computes the layers' linears, norms and RoPE
        (`model/ops.py`; a runner passes its kernels' there). `head`: a projection to run
        instead of lm_head (the draft's slice of it, `engine/draft_vocab.py`: logits [B, T, n]).
        """
        self.check_path(path)
        x = self.embed(tokens)  # [B, T, hidden]
        cos, sin = self.rotary_emb(input_pos, x.dtype, cache.rope_capacity)  # [T, D] each
        local = None
        if self.config.layer.local_rope:
            local = self.local_rotary_emb(input_pos, x.dtype)
        for layer in self.layers:
            if layer.local:
                x = layer(x, *local, input_pos, cache, path, ops)
            else:
                x = layer(x, cos, sin, input_pos, cache, path, ops)
        return self.head(x, path, last_only, ops, head)

    def check_path(self, path: Precision) -> None:
        """Raise unless this model holds `path`'s weights."""
        if path.weights not in self.weight_sets:
            raise ValueError(
                f"the model has no {path.weights} weights (a `qspec convert` folder has them)"
            )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> the first layer's input [B, T, hidden] (a fresh tensor), in the
        model's dtype: a table kept narrower (`build_model`) has its rows cast, exactly."""
        x = self.embed_tokens(tokens).to(self.dtype)
        if self.config.layer.embed_scale:  # (the scale cast to x's dtype first, as HF does)
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def head(
        self,
        x: torch.Tensor,
        path: Precision,
        last_only: bool = False,
        ops: LayerOps = TORCH_OPS,
        head: Linear | None = None,
    ) -> torch.Tensor:
        """The last layer's output [B, T, hidden] -> logits [B, T, V] ([B, 1, V]: last_only),
        through `head` instead of lm_head when given; soft-capped where the config says
        (final_logit_softcapping)."""
        if last_only:
            x = x[:, -1:]
        head = self.lm_head if head is None else head
        logits = ops.linear(head, ops.norm(self.norm, x), path)
        cap = self.config.final_logit_softcapping  # (Gemma 2: monotone, so argmax unchanged)
        return logits if cap is None else soft_cap(logits, cap)


def local_rope_config(config: ModelConfig) -> ModelConfig:
    """The config of Gemma 3's sliding layers' RoPE: plain, of base rope_local_base_freq."""
    return replace(
        config, rope_theta=config.rope_local_base_freq, rope_scaling={"rope_type": "default"}
    )


@torch.inference_mode()
def forward_logits(model, cache: KVCache, tokens: list[int], path: Precision, chunk_size: int):
    """Teacher-forced logits [T, V] (fp32) of every position, fed in chunks, committing each.
    `model`: the model itself (the PyTorch reference) or a runner over it (its call)."""
    out = []
    for start in range(0, len(tokens), chunk_size):
        piece = tokens[start : start + chunk_size]
        pos = torch.arange(start, start + len(piece), device=model.device)
        out.append(model(torch.tensor([piece], device=model.device), pos, cache, path)[0].float())
        cache.commit(start + len(piece))
    return torch.cat(out)


def linear_layers(model: Transformer) -> dict[str, Linear]:
    """Every linear layer by its HF name ("layers.0.self_attn.q_proj", ..., "lm_head")."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _attach(model: Transformer, twins: dict[str, nn.Module], attribute: str) -> None:
    layers = linear_layers(model)
    unknown = twins.keys() - layers.keys()
    if unknown:
        raise KeyError(f"no such linear layers: {sorted(unknown)[:4]}")
    for name, twin in twins.items():
        setattr(layers[name], attribute, twin)  # a submodule: `<name>.draft.packed`, ...


def attach_draft(model: Transformer, drafts: dict[str, nn.Module]) -> None:
    """Give the named linear layers their 4-bit twins (the draft path's weights)."""
    _attach(model, drafts, "draft")
    if drafts:
        model.weight_sets.add("int4")


def has_draft(model: Transformer) -> bool:
    """Whether the model carries 4-bit draft weights (a `qspec convert` folder)."""
    return "int4" in model.weight_sets


def attach_int8(model: Transformer, layers: dict[str, nn.Module]) -> None:
    """Give the named linear layers their INT8 twins (the INT8-weight target's weights)."""
    _attach(model, layers, "int8")
    if all(m.int8 is not None for m in linear_layers(model).values()):
        model.weight_sets.add("int8")  # "int8" runs every linear on them
        if all(m.in_features % ACT_CHUNK == 0 for m in linear_layers(model).values()):
            model.weight_sets.add("w8a8")  # (int8 activations come in whole 64-input chunks)


def has_int8(model: Transformer) -> bool:
    """Whether every linear has its INT8 twin (`weights="int8"` runs)."""
    return "int8" in model.weight_sets
