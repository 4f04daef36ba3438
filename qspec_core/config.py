"""One config dataclass for every supported model, built from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from kernels import MAX_DRAFTS
from qspec_core.errors import QspecError, UnsupportedModelError
from qspec_core.families import Family, LayerSpec, family_for, supported_names
from qspec_core.families import supported_model_types as _supported_model_types
from qspec_core.families.spec import ACTIVATIONS

SUPPORTED_MODEL_TYPES = _supported_model_types()  # one file each in qspec_core/families/
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters under their Hugging Face names (see `from_hf_config`)."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    # channels RoPE rotates, the first of each head's (head_dim times HF partial_rotary_factor:
    # Phi-4-mini's 0.75); the rest pass through. None: all
    rotary_dim: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_parameters` minus `rope_theta`: {"rope_type": ..., "factor": ..., ...}
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    layer: LayerSpec = field(default_factory=LayerSpec)  # the family's, with its biases
    tie_word_embeddings: bool = False
    # the local layers' window (query at p sees positions > p - window); which layers are
    # local: `layer_types` ("sliding_attention"), or every layer when it is empty. None: none
    sliding_window: int | None = None
    # read where the family's layer says so (LayerSpec.query_pre_attn_scalar, .local_rope)
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention", per layer
    # (also Gemma 3's choice of RoPE per layer: `LayerSpec.local_rope`)
    rope_local_base_freq: float | None = None
    # Gemma 2's soft caps (LayerSpec.softcapping): of the scaled attention scores, of the logits
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotated(self) -> int:
        """Channels RoPE rotates per head."""
        return self.rotary_dim or self.head_dim

    def native_ok(self) -> bool:
        """Whether the CPU runner's one-call C++ step computes this model's layer
        (`LayerSpec.native_ok`; a partial rotary too: the C++ RoPE rotates cos's width)."""
        return self.layer.native_ok()

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def context_limit(self) -> int:
        """Longest sequence this model runs: its max_position_embeddings (the caches apply
        each local layer's sliding window, `window`; LongRoPE picks its factors by the cache's
        capacity, `model/rope.py`)."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window: its query at position p sees the keys at positions
        > p - window (transformers' `sliding_window`); None: a global layer, all keys."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's `window`, in order."""
        return tuple(self.window(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelConfig:
        """Build from a parsed `config.json`; unknown keys are ignored, unsupported ones refused.

        Every key read is type-checked: a hand-edited or damaged config (a string where a
        number belongs, a list instead of an object) is a `ConfigError` naming the key, not
        a TypeError deep inside the model's constructor.
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"expected a JSON object, not {_json_kind(hf)}")
        model_type = hf.get("model_type")
        family = family_for(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; qspec runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} ({supported_names()})"
            )
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"  # (Gemma's name)
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {act!r} is not supported (only {', '.join(ACTIVATIONS)})"
            )
        layer = replace(_layer(family, hf), activation=act)
        caps = {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if layer.softcapping:
                caps[key] = _positive_number(hf, key, None)
            elif hf.get(key) is not None:
                raise UnsupportedModelError(f"{key} is not supported for {family.label}")
        n_heads = _int(hf, "num_attention_heads")
        hidden_size = _int(hf, "hidden_size")
        head_dim = _int(hf, "head_dim", None)
        if head_dim is None:
            if hidden_size % n_heads:
                raise ConfigError(
                    f"hidden_size {hidden_size} is not a multiple of num_attention_heads "
                    f"{n_heads} (and there is no head_dim)"
                )
            head_dim = hidden_size // n_heads
        if head_dim % 2:  # RoPE rotates pairs of channels; the KV planes pack pairs of nibbles
            raise UnsupportedModelError(f"an odd head_dim ({head_dim}) is not supported")
        n_kv_heads = _int(hf, "num_key_value_heads", n_heads)
        if n_heads % n_kv_heads:
            raise ConfigError(
                f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads "
                f"{n_kv_heads}"
            )
        max_positions = _int(hf, "max_position_embeddings", 2048)
        rope, local_theta = _rope_parameters(hf), None
        if layer.local_rope:
            rope, local_theta = _local_rope(hf)
        # (transformers 5 keeps it in rope_parameters, 4 at the top level: Phi-4-mini's 0.75)
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        rotated = _rotary_dim(1.0 if partial is None else partial, head_dim)
        if rope["rope_type"] == "longrope":
            _longrope_factors(rope, rotated)
        sliding_window, layer_types = _sliding_window(family, hf)
        return cls(
            model_type=model_type,
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(hf, "intermediate_size"),
            num_hidden_layers=_int(hf, "num_hidden_layers"),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=head_dim,
            rotary_dim=None if rotated == head_dim else rotated,
            max_position_embeddings=max_positions,
            rms_norm_eps=_positive_number(hf, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.pop("rope_theta")),
            rope_scaling=rope,
            layer=layer,
            # (Gemma's configs leave it out: transformers' default for them is True)
            tie_word_embeddings=_bool(hf, "tie_word_embeddings", family.ties_embeddings),
            sliding_window=sliding_window,
            bos_token_id=_token_id(hf, "bos_token_id"),
            eos_token_id=token_ids(hf.get("eos_token_id"), "eos_token_id"),
            query_pre_attn_scalar=(
                _positive_number(hf, "query_pre_attn_scalar", float(head_dim))
                if layer.query_pre_attn_scalar
                else None
            ),
            layer_types=layer_types,
            rope_local_base_freq=local_theta,
            **caps,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Parse `config.json`; a file that is not a JSON object is a `ConfigError`."""
        try:
            hf = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"not a readable JSON file ({e})") from None
        return cls.from_hf_config(hf)


def check_kv_group_size(
    group_size: int | None, head_dim: int | None = None, gamma: int | str | None = None
) -> None:
    """Refuse a KV quantization group G (`--group-size`) the hierarchical cache cannot run.

    Call it twice: before the model loads with what the options alone decide (head_dim None),
    and again once the model's head_dim is known (G defaults to it). `gamma`: the drafts per
    round when a speculative mode runs on the hierarchical cache, else None.
    - G >= 2 and even: the fused attention kernels (C++ and Triton) and the Triton value
      quantizer work on pairs of channels (kernels/triton/hier_attention.py, kv_pack.py);
    - G divides head_dim: values are quantized per token in groups of G channels;
    - gamma < G (`check_gamma`).
    """
    if group_size is not None and (group_size < 2 or group_size % 2):
        raise QspecError(
            f"--group-size must be an even number >= 2 that divides the model's head_dim "
            f"(e.g. 32 or 64), not {group_size}"
        )
    G = group_size or head_dim
    if G is None:
        return
    if head_dim is not None and head_dim % G:
        raise QspecError(
            f"--group-size {G} does not divide the model's head_dim {head_dim}; use a divisor "
            f"of it (e.g. {head_dim // 2} or {head_dim})"
        )
    check_gamma(gamma, G, g_is_head_dim=not group_size)


def gamma_limit(group_size: int | None = None) -> int:
    """The most drafts a round may verify: MAX_DRAFTS (a verify's gamma + 1 rows are a step
    of the kernels' `MAX_STEP_ROWS`) and, over a hierarchical cache of KV group `group_size`
    (None: none), below G: the verify's tokens must fit the G positions of slack of its
    full-precision buffer (`cache/hierarchical.py`)."""
    return MAX_DRAFTS if group_size is None else min(MAX_DRAFTS, group_size - 1)


def check_gamma(
    gamma: int | str | None, group_size: int | None = None, g_is_head_dim: bool = False
) -> None:
    """Refuse drafts per round (`--gamma`) beyond `gamma_limit(group_size)`: the one check
    of gamma, which the CLI makes before anything loads and the engine before it decodes.
    "auto" (each round picks within the limit) and None (no speculative mode) pass.
    `g_is_head_dim`: G was not chosen but defaults to the model's head_dim (said so)."""
    if gamma is None or gamma == "auto":
        return
    if not 1 <= int(gamma) <= MAX_DRAFTS:
        raise QspecError(f"--gamma must be in 1..{MAX_DRAFTS}, not {gamma}")
    if int(gamma) > gamma_limit(group_size):
        raise QspecError(
            f"--gamma {gamma} needs a KV group size above it (G = {group_size}"
            f"{', the head_dim' if g_is_head_dim else ''}): use --gamma {group_size - 1} or less"
        )


class ConfigError(QspecError):
    """A `config.json` that is damaged: a missing key or a value of the wrong type."""


_REQUIRED = object()


def _json_kind(value) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return kinds.get(type(value), "a number")


def _int(hf: dict, key: str, default=_REQUIRED, minimum: int = 1):
    """hf[key] as an int >= minimum; `default` when absent or null (required if not given)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{key} is missing")
        return default
    # bool is an int subclass, and JSON true must not pass for 1
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, not {value!r}")
    return value


def _positive_number(hf: dict, key: str, default: float | None) -> float | None:
    value = hf.get(key, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value < math.inf  # (Python's json reads NaN and Infinity)
    ):
        raise ConfigError(f"{key} must be a positive number, not {value!r}")
    return float(value)


def _bool(hf: dict, key: str, default: bool = False) -> bool:
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):  # bool("false") is True: refuse rather than guess
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    return value


def _token_id(hf: dict, key: str) -> int | None:
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{key} must be a token id (an integer >= 0), not {value!r}")
    return value


def token_ids(value, key: str = "eos_token_id") -> tuple[int, ...]:
    """An `eos_token_id`-style value (null, an id, or a list of ids) as a tuple of ids.

    Shared with the tokenizer, which reads the same key from `generation_config.json`.
    """
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigError(f"{key} must be a token id or a list of them, not {value!r}")
    return tuple(items)


# RoPE parameters each scaling type reads (qspec_core/rope.py), checked here so that a
# config without them is refused when read, not with a KeyError while the model is built.
_ROPE_NUMBERS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings",),
}


def _renamed(raw: dict) -> dict:
    """A RoPE object with transformers 4's "type" as "rope_type" (default: "default")."""
    rope = dict(raw)
    if "rope_type" not in rope:  # transformers 4 wrote "type"
        rope["rope_type"] = rope.pop("type", "default")
    return rope


def _rope_parameters(hf: dict) -> dict:
    """Normalize transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`)."""
    raw = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_parameters/rope_scaling must be an object, not {raw!r}")
    rope = _renamed(raw)
    older = hf.get("rope_scaling")
    if hf.get("rope_parameters") and isinstance(older, dict):  # both: neither may win silently
        older = _renamed(older)
        for key in rope.keys() & older.keys():
            if rope[key] != older[key]:
                raise ConfigError(
                    f"rope_parameters and rope_scaling disagree on {key} ({rope[key]!r} against "
                    f"{older[key]!r}); keep one of them"
                )
    if rope["rope_type"] == "su":  # (LongRoPE's first name, in early Phi-3-128k configs)
        rope["rope_type"] = "longrope"
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if rope["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {rope['rope_type']!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    if rope["rope_type"] in ("yarn", "llama3", "longrope"):
        # (Phi-3.5 keeps it at the top level of config.json)
        original = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        rope.setdefault("original_max_position_embeddings", original)
    for key in ("rope_theta", *_ROPE_NUMBERS.get(rope["rope_type"], ())):
        if rope.get(key) is None:
            raise ConfigError(f"RoPE scaling {rope['rope_type']!r} needs {key}")
        _positive_number(rope, key, 0.0)
    return rope


def _rotary_dim(partial, head_dim: int) -> int:
    """Channels rotated per head: int(head_dim * partial_rotary_factor), as transformers
    rounds it; a positive even number up to head_dim."""
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
        raise ConfigError(f"partial_rotary_factor must be a number in (0, 1], not {partial!r}")
    rotated = int(head_dim * partial)
    if rotated < 2 or rotated % 2:
        raise UnsupportedModelError(
            f"a partial rotary of {rotated} channels (head_dim {head_dim} x {partial}) is not "
            "supported: RoPE rotates pairs"
        )
    return rotated


def _longrope_factors(rope: dict, rotated: int) -> None:
    """LongRoPE's short_factor and long_factor: one positive number per rotated channel pair."""
    pairs = rotated // 2
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if (
            not isinstance(factors, list)
            or len(factors) != pairs
            or not all(
                isinstance(f, int | float) and not isinstance(f, bool) and 0 < f < math.inf
                for f in factors
            )
        ):
            raise ConfigError(f"RoPE scaling 'longrope' needs {key}: {pairs} positive numbers")


def _layer(family: Family, hf: dict) -> LayerSpec:
    """The family's layer with the biases its config switches on."""
    layer = family.layer
    if family.reads_attention_bias and _bool(hf, "attention_bias"):
        layer = replace(layer, qkv_bias=True, o_bias=True)
    if family.reads_mlp_bias and _bool(hf, "mlp_bias"):
        layer = replace(layer, mlp_bias=True)
    return layer


def _local_rope(hf: dict) -> tuple[dict, float]:
    """Gemma 3's two RoPEs: the full-attention layers' (parsed as any model's) and the sliding
    layers' plain one, from transformers 5's rope_parameters per layer type, or 4's
    rope_theta / rope_scaling and rope_local_base_freq."""
    raw = hf.get("rope_parameters")
    if isinstance(raw, dict) and "full_attention" in raw:
        local = raw.get("sliding_attention") or {}
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("a scaled RoPE on the sliding layers is not supported")
        rope = _rope_parameters({**hf, "rope_parameters": raw["full_attention"]})
        return rope, _positive_number(local, "rope_theta", 10000.0)
    return _rope_parameters(hf), _positive_number(hf, "rope_local_base_freq", 10000.0)


def _layer_types(hf: dict, pattern: int) -> tuple[str, ...]:
    """config.json's layer_types, or (transformers 4) every `sliding_window_pattern`-th
    layer global, the rest local."""
    n_layers = _int(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        pattern = _int(hf, "sliding_window_pattern", pattern, minimum=1)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(kinds):
        raise ConfigError(f"layer_types must list {n_layers} of {kinds}, not {types!r}")
    return tuple(types)


def _sliding_window(family: Family, hf: dict) -> tuple[int | None, tuple[str, ...]]:
    """(the local layers' window, layer_types) as the family reads them (`Family.
    sliding_window`); layer_types () when every layer is local or none is."""
    kind = family.sliding_window
    if kind == "none":
        return None, ()
    window = _int(hf, "sliding_window", None, minimum=0) or None  # 0 and null: no window
    if kind == "layer_types":  # (Gemma 3's local RoPE reads them even without a window)
        return window, _layer_types(hf, family.window_pattern)
    if kind == "qwen":
        # Qwen applies the window only when enabled, and then to layers >= max_window_layers
        # (transformers' default, or the layer_types its config.json lists)
        if not _bool(hf, "use_sliding_window") or window is None:
            return None, ()
        n_layers = _int(hf, "num_hidden_layers")
        first = _int(hf, "max_window_layers", 28, minimum=0)
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
        ]
        types = _layer_types({**hf, "layer_types": list(types)}, 1)
        return (window, types) if "sliding_attention" in types else (None, ())
    return window, ()
