"""A GGUF file as a bf16 Hugging Face folder, without transformers.

Covers the registry's models: Llama-arch (SmolLM2) and Qwen2-arch (Qwen2.5, qkv biases) files
with a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2"), and Llama 3.x's scaled RoPE,
which llama.cpp stores as divisors (`rope_freqs.weight`) and this reads back as the HF
"llama3" rope_parameters they come from (transformers drops the tensor). The folder is the one
transformers 5 writes for the same file (`from_pretrained(gguf_file=...)`, `save_pretrained`),
which is what qspec used before: the same bf16 tensors bit for bit (dequantized to float32 by
`gguf.quants.dequantize`, then rounded by torch), the same config.json less
`transformers_version`, a tokenizer.json that encodes the same, the same special tokens and
chat template. tests/test_gguf_import.py checks all of it against transformers, on the real
default model and on small written GGUFs.

What this does not cover raises `NotCovered`, and the caller converts with transformers as
before; a damaged file is a `QspecError` ("cannot read GGUF ...").
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from qspec_core.errors import UnsupportedModelError
from qspec_core.registry.gguf_file import GGUFFile, TensorInfo


class NotCovered(Exception):
    """A well-formed GGUF this reader does not convert; the message says what it has."""


# transformers' LlamaConfig / Qwen2Config as save_pretrained writes them: the class defaults
# a GGUF does not state (facts of transformers 5.24's output; qspec reads hidden_act, the
# biases and the sliding-window keys among them).
_ARCH_CONFIG = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_window_layers": 28,
        "sliding_window": None,
        "use_cache": True,
        "use_sliding_window": False,
    },
}

# GGUF metadata key (after "<arch>.") -> HF config key; the same for both architectures
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base")
_TOKEN_IDS = {  # tokenizer.ggml.<key> -> (config key, tokenizer_config key)
    "bos_token_id": ("bos_token_id", "bos_token"),
    "eos_token_id": ("eos_token_id", "eos_token"),
    "unknown_token_id": ("unk_token_id", "unk_token"),
    "padding_token_id": ("pad_token_id", "pad_token"),
}

# GGUF tensor names -> HF names (llama.cpp's standard names: gguf's MODEL_TENSORS)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Llama 3.x's scaled RoPE: llama.cpp's converter writes the per-frequency divisors as a tensor
# [head_dim / 2] and no rope.scaling keys; hf_config finds the HF "llama3" parameters they
# come from (_llama3_parameters)
_ROPE_FREQS = "rope_freqs.weight"
_QKV_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}

# `tokenizer.ggml.pre` -> how the text is split before the byte-level BPE, as transformers'
# GGUF converter does it: a Split on the model's regex, else GPT-2's ByteLevel regex. Names
# not listed here go to transformers.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    None: None,  # (files older than the key)
    "default": None,
    "gpt-2": None,
    "smollm": None,  # (transformers has no entry for it: GPT-2's regex)
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's enum)
_GPT2_DEFAULT_SPECIAL = "<|endoftext|>"  # GPT2Tokenizer's unk/bos/eos, which it always adds


def convert_gguf(path: Path, folder: Path) -> None:
    """Write `path` as a Hugging Face folder into the existing, empty `folder`:
    config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
    tokenizer_config.json, chat_template.jinja (when the file has one)."""
    from safetensors.torch import save_file

    gguf = GGUFFile(path)
    meta = gguf.meta
    check_covered(gguf)
    config = hf_config(gguf)
    tensors = hf_tensors(gguf, config)
    tokenizer, tokenizer_config = hf_tokenizer(gguf)
    _write_json(folder / "config.json", config)
    generation = {"_from_model_config": True}
    generation |= {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    generation = {k: v for k, v in generation.items() if v is not None}
    _write_json(folder / "generation_config.json", generation)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save(str(folder / "tokenizer.json"))
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config)


# GGUF architecture -> the Hugging Face model_type it converts to, where the names differ
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


def check_runnable(path: Path) -> None:
    """Refuse, before any conversion, a GGUF that no converter would make runnable here: one
    without an architecture or a tokenizer (damaged), or of an architecture qspec does not run
    (transformers could convert it, but not into a model qspec runs). A big-endian file is
    left to transformers."""
    from qspec_core.families import supported_model_types, supported_names
    from qspec_core.registry.gguf_file import BigEndianGGUF

    try:
        gguf = GGUFFile(path)
    except BigEndianGGUF:
        return
    arch = gguf.meta.get("general.architecture")
    if not isinstance(arch, str):
        raise gguf.damaged("no architecture (general.architecture)")
    if _GGUF_MODEL_TYPES.get(arch, arch) not in supported_model_types():
        raise UnsupportedModelError(
            f"GGUF {path}: architecture {arch!r}, which qspec does not run (it runs "
            f"{supported_names()})"
        )
    if not isinstance(gguf.meta.get("tokenizer.ggml.model"), str):
        raise gguf.damaged("no tokenizer (tokenizer.ggml.model)")


def check_covered(gguf: GGUFFile) -> None:
    """Raise `NotCovered` unless this reader converts the file exactly as transformers would."""
    meta = gguf.meta
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in _ARCH_CONFIG:
        raise NotCovered(f"architecture {arch!r}")
    missing = [f"{arch}.{k}" for k in _CONFIG_KEYS if f"{arch}.{k}" not in meta]
    if missing:  # transformers would fill in its class defaults
        raise NotCovered(f"no {', '.join(missing)} in the metadata")
    for key in _CONFIG_KEYS:  # (a per-layer list of head counts, say: transformers' case)
        value = meta[f"{arch}.{key}"]
        kinds = (int, float) if key in _FLOAT_KEYS else int
        if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
            raise NotCovered(f"{arch}.{key} = {value!r}")
    if any(key.startswith(f"{arch}.rope.scaling.") for key in meta):
        raise NotCovered("RoPE scaling")
    tokenizer = meta.get("tokenizer.ggml.model")
    if tokenizer != "gpt2":
        raise NotCovered(f"tokenizer model {tokenizer!r}")
    pre = meta.get("tokenizer.ggml.pre")
    if not isinstance(pre, str | None) or pre not in PRE_TOKENIZERS:
        raise NotCovered(f"pre-tokenizer {pre!r}")
    if "tokenizer.ggml.merges" not in meta:
        raise NotCovered("a byte-level vocabulary without merges")
    for key, kind in (("tokens", str), ("merges", str), ("token_type", int)):
        values = meta.get(f"tokenizer.ggml.{key}", [])
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise gguf.damaged(f"tokenizer.ggml.{key} is not a list of {kind.__name__}")
    n_tokens = len(meta.get("tokenizer.ggml.tokens", []))
    for key in _TOKEN_IDS:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < n_tokens):
            raise gguf.damaged(f"tokenizer.ggml.{key} {token_id!r} is not in the vocabulary")
    n_layers = meta[f"{arch}.block_count"]
    if n_layers * len(_LAYER_TENSORS) > len(gguf.tensors):
        raise NotCovered(f"{n_layers} layers in {len(gguf.tensors)} tensors")
    expected = set(_expected_tensors(arch, n_layers, gguf))
    names = {info.name for info in gguf.tensors}
    if names != expected:
        odd = sorted(names - expected)[:3] or [f"no {n}" for n in sorted(expected - names)[:3]]
        raise NotCovered(f"tensors {', '.join(odd)}")


def _expected_tensors(arch: str, n_layers: int, gguf: GGUFFile) -> dict[str, str]:
    """GGUF name -> HF name of every tensor a file of this architecture holds."""
    untied = any(info.name == "output.weight" for info in gguf.tensors)  # absent: tied
    mapping = {g: hf for g, hf in _GLOBAL_TENSORS.items() if untied or g != "output.weight"}
    if arch == "llama" and any(info.name == _ROPE_FREQS for info in gguf.tensors):
        mapping[_ROPE_FREQS] = ""  # (read into config.json, not a weight)
    per_layer = _LAYER_TENSORS | (_QKV_BIASES if arch == "qwen2" else {})
    for i in range(n_layers):
        for gguf_name, hf_name in per_layer.items():
            mapping[f"blk.{i}.{gguf_name}"] = f"model.layers.{i}.{hf_name}"
    return mapping


def hf_config(gguf: GGUFFile) -> dict:
    """config.json: the architecture's class defaults, the file's numbers, its token ids."""
    meta = gguf.meta
    arch = meta["general.architecture"]
    config = dict(_ARCH_CONFIG[arch])
    for key, hf_key in _CONFIG_KEYS.items():
        config[hf_key] = meta[f"{arch}.{key}"]
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    freqs = next((info for info in gguf.tensors if info.name == _ROPE_FREQS), None)
    if arch == "llama":  # transformers reads rope.dimension_count as head_dim for llama only
        derived = config["hidden_size"] // config["num_attention_heads"]
        config["head_dim"] = meta.get(f"{arch}.rope.dimension_count", derived)
        if freqs is not None:
            config["rope_parameters"] |= _llama3_parameters(gguf, freqs, config)
    else:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config["vocab_size"] = meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))
    config["tie_word_embeddings"] = all(info.name != "output.weight" for info in gguf.tensors)
    for key, (hf_key, _) in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in meta:
            config[hf_key] = meta[f"tokenizer.ggml.{key}"]
    if "general.name" in meta:
        config["_model_name_or_path"] = meta["general.name"]
    config["dtype"] = "bfloat16"
    return config


def hf_tensors(gguf: GGUFFile, config: dict) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized to float32 by `gguf`, under its HF name, rounded to bf16.

    A few tensors at a time in threads (numpy and torch release the GIL): 2.4x faster than
    one by one on 2 cores, for the same bits.
    """
    from gguf.quants import dequantize

    arch = config["model_type"]
    names = _expected_tensors(arch, config["num_hidden_layers"], gguf)
    shapes = _hf_shapes(config)
    infos = [info for info in gguf.tensors if info.name != _ROPE_FREQS]
    for info in infos:
        expected = shapes(names[info.name])
        if info.shape != expected:
            raise gguf.damaged(f"tensor {info.name} has shape {info.shape}, expected {expected}")

    def bf16(info: TensorInfo) -> torch.Tensor:
        values = dequantize(gguf.raw(info), info.ggml_type)  # float32 [*shape]
        if not values.flags.writeable:  # F32: a view of the read-only map
            values = values.copy()
        weight = torch.from_numpy(values).to(torch.bfloat16)  # round to nearest even
        if arch == "llama" and info.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"]
            if ".attn_k." in info.name:
                heads = config["num_key_value_heads"]
            weight = _unpermute_rope_rows(weight, heads)
        return weight.contiguous()

    try:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            weights = list(pool.map(bf16, infos))
    except NotImplementedError as e:  # a ggml type gguf has no dequantizer for
        raise gguf.damaged(f"gguf cannot dequantize it ({e})") from None
    return {names[info.name]: weight for info, weight in zip(infos, weights, strict=True)}


# Llama 3.1-3.3's rope_scaling; the band's edges fix only old_len / high and old_len / low, so
# these two ratios are what a file can be checked against, and these the numbers it is given
_LLAMA3_BANDS = (1.0, 4.0)  # low_freq_factor, high_freq_factor
_LLAMA3_OLD_LEN = 8192  # original_max_position_embeddings


def _llama3_parameters(gguf: GGUFFile, info: TensorInfo, config: dict) -> dict:
    """HF's "llama3" rope_parameters whose divisors are the file's `rope_freqs.weight`, found
    from the divisors themselves (a blended one gives old_len; none: Llama 3's 8192) and
    checked by recomputing all of them as llama.cpp's converter does; other divisors are
    NotCovered. All ones: no scaling ({})."""
    from gguf.quants import dequantize

    half = config["head_dim"] // 2
    if info.shape != (half,):
        raise gguf.damaged(f"tensor {info.name} has shape {info.shape}, expected {(half,)}")
    divisors = dequantize(gguf.raw(info), info.ggml_type).astype("float64")
    if not all(math.isfinite(d) and d >= 1.0 for d in divisors):
        raise NotCovered(f"{_ROPE_FREQS} with divisors below 1 or not finite")
    factor = float(divisors.max())
    if factor == 1.0:
        return {}
    low, high = _LLAMA3_BANDS
    theta, dim = config["rope_parameters"]["rope_theta"], config["head_dim"]
    wavelen = [2 * math.pi * theta ** (2 * i / dim) for i in range(half)]
    old_len = _LLAMA3_OLD_LEN
    for d, w in zip(divisors, wavelen, strict=True):
        if 1.0 < d < factor:  # 1 / d = (1 - s) / factor + s, s = (old_len / w - low) / (high - low)
            smooth = (1 / d - 1 / factor) / (1 - 1 / factor)
            old_len = round(w * (smooth * (high - low) + low))
            break
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_len,
    }
    if not _divisors_match(params, wavelen, divisors):
        raise NotCovered(f"{_ROPE_FREQS} that is not Llama 3's RoPE scaling")
    return params


def _divisors_match(params: dict, wavelen: list[float], divisors) -> bool:
    """Whether the llama3 `params` give `divisors` (to float32's precision, as stored)."""
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    for d, w in zip(divisors, wavelen, strict=True):
        if w < old_len / high:
            want = 1.0
        elif w > old_len / low:
            want = factor
        else:
            smooth = (old_len / w - low) / (high - low)
            want = 1 / ((1 - smooth) / factor + smooth)
        if abs(d - want) > 1e-5 * want:
            return False
    return True


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp's converter gives Llama's q and k projections.

    ggml's RoPE rotates adjacent channels (2i, 2i+1); HF's rotates channel i with i + D/2. So
    the converter reorders each head's rows from (half, i) to (i, half); this is the inverse,
    the one transformers applies (its LlamaTensorProcessor), and only a reordering: it commutes
    with the bf16 rounding.
    """
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def _hf_shapes(config: dict):
    """HF name -> the shape its tensor must have under this config."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    rows = {
        "q_proj": heads * head_dim,
        "k_proj": kv_heads * head_dim,
        "v_proj": kv_heads * head_dim,
        "o_proj": hidden,
        "gate_proj": ffn,
        "up_proj": ffn,
        "down_proj": hidden,
    }
    cols = {"o_proj": heads * head_dim, "down_proj": ffn}

    def shape(name: str) -> tuple[int, ...]:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (config["vocab_size"], hidden)
        module, kind = name.split(".")[-2:]
        if module not in rows:  # a norm
            return (hidden,)
        return (rows[module],) if kind == "bias" else (rows[module], cols.get(module, hidden))

    return shape


def hf_tokenizer(gguf: GGUFFile):
    """The byte-level BPE tokenizer transformers' GGUF converter builds, and the
    tokenizer_config.json entries qspec and transformers read (special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    meta = gguf.meta
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or []
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # a token outside the byte alphabet is written in it: its UTF-8 bytes, spelled
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): i
        for i, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    if any(len(pair) != 2 for pair in merges):
        raise gguf.damaged("a merge that is not two tokens")
    try:
        bpe = BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    except Exception as e:  # the Rust side raises bare Exceptions: a merge of unknown tokens
        raise gguf.damaged(f"its merges do not fit its vocabulary ({e})") from None
    tokenizer = Tokenizer(bpe)
    split = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre")]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()

    special = {}  # tokenizer_config key -> token (ids checked by check_covered)
    for key, (_, name) in _TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        special[name] = tokens[token_id] if token_id is not None else None
    # Added tokens, in transformers' order: GPT-2's default special token, the file's control
    # tokens (those spelled in the byte alphabet: others are llama.cpp mislabels), its
    # user-defined ones (matched whole, not special), then the named special tokens.
    tokenizer.add_special_tokens([AddedToken(_GPT2_DEFAULT_SPECIAL, special=True)])
    typed = list(zip(tokens, token_types, strict=False))  # (a short token_type list: none)
    control = [t for t, kind in typed if kind == _CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in typed if kind == _USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    added = {str(t) for t in tokenizer.get_added_tokens_decoder().values()}
    named = [t for t in dict.fromkeys(special.values()) if t is not None and t not in added]
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in named])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token")) and special["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and special["eos_token"] is not None
    tokenizer.post_processor = _template(meta, special, add_bos, add_eos)
    config = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", **special}
    if add_bos:
        config["add_bos_token"] = True
    if add_eos:
        config["add_eos_token"] = True
    return tokenizer, config


def _template(meta: dict, special: dict, add_bos: bool, add_eos: bool):
    """The post-processor transformers sets from add_bos_token / add_eos_token."""
    from tokenizers import processors

    bos, eos = special["bos_token"], special["eos_token"]
    first, last = (f"{bos}:0 " if add_bos else ""), (f" {eos}:0" if add_eos else "")
    single = f"{first}$A:0{last}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    ids = []
    if add_bos:
        ids.append((bos, meta["tokenizer.ggml.bos_token_id"]))
    if add_eos:
        ids.append((eos, meta["tokenizer.ggml.eos_token_id"]))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    spelling |= {b: chr(256 + n) for n, b in enumerate(shifted)}
    return spelling


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
