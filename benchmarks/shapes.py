"""Random-weight checkpoints of real model shapes: inputs for measuring time and memory.

Every shape is a real model's (its config.json, layer count, widths, heads and vocabulary);
the weights are noise, N(0, 0.02) with RMSNorm weights 1, so generated text is noise too.
Nothing is downloaded: the tokenizer is SmolLM2-135M-Instruct's, from qspec's model cache.

    python benchmarks/shapes.py --list
    nice -n 19 python benchmarks/shapes.py llama-3.2-1b [qwen2.5-7b ...] [-o DIR]
        [--gguf q8_0,q4_0 | --gguf none] [--force] [--dry-run]

Per shape, in DIR (default benchmarks/models/, which git ignores):
  <shape>-random/            Hugging Face folder: config.json, generation_config.json, bf16
                             model.safetensors (past 4 GB: model-0000i-of-0000n.safetensors
                             shards and model.safetensors.index.json), tokenizer files, README.md
  <shape>-random.Q8_0.gguf   the same weights for llama.cpp, every matrix Q8_0
  <shape>-random.Q4_0.gguf   the same, every matrix Q4_0

Existing outputs are kept (--force rewrites them); --dry-run prints the planned files and
sizes, headers included, and leaves DIR untouched.

How the weights are made:
- Deterministic: each tensor comes from its own torch.Generator, seeded from a hash of SEED
  and the tensor's name, drawn in row blocks whose size depends only on the tensor's shape;
  a rerun writes the same bytes, and an output written later holds the same weights as one
  written earlier.
- Streamed: one block (at most 2^24 values) at a time, never the whole model: the
  safetensors header is computed from the shapes and written first, the GGUF's metadata and
  tensor table too (gguf.GGUFWriter), then each block's bytes as it is generated. All the
  outputs of a shape are written in one pass, each block generated once; the GGUFs quantize
  its bf16 values (gguf.quants.quantize), so they hold the safetensors' weights.
- Atomic: every output is written under a temporary name and renamed when complete; Ctrl-C
  or SIGTERM removes the temporary files (a kill -9 leaves a hidden `.<name>...tmp` entry).

The configs are the Instruct models' config.json as published (transformers 4's spelling:
rope_theta and rope_scaling, which qspec reads, Llama 3.x's "llama3" scaling included), with
SmolLM2's token ids (bos 1, eos 2, pad 2) and head_dim stated in all of them (Llama 3.2 ships
it; the others derive the same number). The model's vocabulary is the real one: ids from
49152 up are never produced by the tokenizer, and are "[PAD<id>]" filler tokens (type UNUSED)
in the GGUFs.

The GGUFs follow llama.cpp's converter (convert_hf_to_gguf.py) where it matters for what
llama.cpp computes: Llama's q/k rows reordered for ggml's RoPE, Llama 3.x's RoPE scaling as
a `rope_freqs.weight` tensor, 1-D tensors F32. They differ from llama-quantize's files in
one way: every matrix has the named type, the output (or tied embedding) too, where
llama-quantize would make it Q6_K in a Q4_0 file (gguf has no Q6_K quantizer). qspec's own
GGUF importer refuses the rope_freqs tensor: give qspec the HF folder.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from qspec_core.atomic_write import temp_path
from qspec_core.config import ModelConfig
from qspec_core.errors import QspecError
from qspec_core.paths import models_dir
from qspec_core.registry.gguf_file import GGUFFile
from qspec_core.registry.sources import DEFAULT_MODEL

SEED = 20250101
STD = 0.02  # the configs' initializer_range
SHARD_BYTES = 4 * 10**9  # a safetensors shard closes before it would pass this ("4GB")
BLOCK_VALUES = 1 << 24  # generated at once: 64 MiB as float32, 32 MiB as bf16
# Blocks start at multiples of this many rows: whole heads (head_dim divides it), so the
# GGUF's per-head row reordering works block by block.
ROW_GRANULE = 256
DEFAULT_OUT = Path(__file__).resolve().parent / "models"
GGUF_TYPES = {
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GB = 10**9


class UsageError(Exception):
    """Bad input or a missing prerequisite: one `error:` line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# The shapes


@dataclass(frozen=True)
class Shape:
    name: str
    mirrors: str  # the Hugging Face model whose config.json `config` is
    config: dict

    @property
    def arch(self) -> str:
        return self.config["model_type"]  # "llama" | "qwen2": llama.cpp's names too


_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "use_cache": True,
    "vocab_size": 128256,
}


def _llama3_rope(factor: float) -> dict:
    # 3.1 and 3.2 stretch Llama 3's 8k pretraining context to 128k: wavelengths longer than
    # 8192 / low_freq_factor divided by `factor`, shorter than 8192 / high_freq_factor kept
    return {
        "factor": factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "use_cache": True,
    "use_sliding_window": False,  # (so sliding_window and max_window_layers change nothing)
}

SHAPES = {
    shape.name: shape
    for shape in (
        Shape(
            "llama-3.2-1b",
            "meta-llama/Llama-3.2-1B-Instruct",
            {
                **_LLAMA3,
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "rope_scaling": _llama3_rope(32.0),
                "tie_word_embeddings": True,
            },
        ),
        Shape(
            "llama-3.2-3b",
            "meta-llama/Llama-3.2-3B-Instruct",
            {
                **_LLAMA3,
                "hidden_size": 3072,
                "intermediate_size": 8192,
                "num_hidden_layers": 28,
                "num_attention_heads": 24,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "rope_scaling": _llama3_rope(32.0),
                "tie_word_embeddings": True,
            },
        ),
        Shape(
            "llama-3.1-8b",
            "meta-llama/Llama-3.1-8B-Instruct",
            {
                **_LLAMA3,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "rope_scaling": _llama3_rope(8.0),
                "tie_word_embeddings": False,
            },
        ),
        Shape(
            "qwen2.5-0.5b",
            "Qwen/Qwen2.5-0.5B-Instruct",
            {
                **_QWEN25,
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "max_position_embeddings": 32768,
                "sliding_window": 32768,
                "max_window_layers": 21,
                "tie_word_embeddings": True,
                "vocab_size": 151936,
            },
        ),
        Shape(
            "qwen2.5-7b",
            "Qwen/Qwen2.5-7B-Instruct",
            {
                **_QWEN25,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "max_position_embeddings": 32768,
                "sliding_window": 131072,
                "max_window_layers": 28,
                "tie_word_embeddings": False,
                "vocab_size": 152064,
            },
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# The tensors


@dataclass(frozen=True)
class Tensor:
    name: str  # Hugging Face's
    gguf_name: str  # llama.cpp's
    shape: tuple[int, ...]  # rows first (GGUF's tensor table lists columns first)
    ones: bool = False  # an RMSNorm weight: 1, as initialized
    # Llama's q/k: llama.cpp's converter reorders each head's rows (its head_dim), 0: not
    rope_head: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def gguf_type(self, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
        return qtype if len(self.shape) == 2 else GGMLQuantizationType.F32

    def gguf_bytes(self, qtype: GGMLQuantizationType) -> int:
        block, size = GGML_QUANT_SIZES[self.gguf_type(qtype)]
        return self.numel // block * size


def tensors(shape: Shape) -> list[Tensor]:
    """The checkpoint's tensors in writing order; a tied lm_head is not one (HF omits it)."""
    c = shape.config
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    rope_head = d if shape.arch == "llama" else 0  # qwen2: ggml's NeoX RoPE, rows as in HF
    out = [Tensor("model.embed_tokens.weight", "token_embd.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        out.append(Tensor(hf + "input_layernorm.weight", gg + "attn_norm.weight", (h,), True))
        for proj, rows, head in (("q", q, rope_head), ("k", kv, rope_head), ("v", kv, 0)):
            hf_proj, gg_proj = f"{hf}self_attn.{proj}_proj", f"{gg}attn_{proj}"
            out.append(Tensor(hf_proj + ".weight", gg_proj + ".weight", (rows, h), rope_head=head))
            if shape.arch == "qwen2":  # Qwen2's q/k/v biases
                out.append(Tensor(hf_proj + ".bias", gg_proj + ".bias", (rows,)))
        out += [
            Tensor(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (h, q)),
            Tensor(hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (h,), True),
            Tensor(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (f, h)),
            Tensor(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (f, h)),
            Tensor(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (h, f)),
        ]
    out.append(Tensor("model.norm.weight", "output_norm.weight", (h,), True))
    if not c["tie_word_embeddings"]:
        out.append(Tensor("lm_head.weight", "output.weight", (c["vocab_size"], h)))
    return out


def rope_freq_factors(config: dict) -> np.ndarray | None:
    """Llama 3.x's RoPE scaling as llama.cpp takes it, `rope_freqs.weight` [head_dim / 2]:
    per frequency, the divisor of the unscaled one (1 for short wavelengths, `factor` for long
    ones, blended between; the frequencies of qspec_core/model/rope.py's _llama3). None when
    the RoPE is not scaled."""
    rope = config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") == "default":
        return None
    if rope["rope_type"] != "llama3":
        raise NotImplementedError(f"RoPE scaling {rope['rope_type']!r} in a GGUF")
    d = config["head_dim"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi * config["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return factors.astype(np.float32)


def hf_config(shape: Shape, token_ids: dict) -> dict:
    return dict(sorted({**shape.config, **token_ids, "torch_dtype": "bfloat16"}.items()))


def check_with_qspec(shape: Shape, planned: list[Tensor]) -> ModelConfig:
    """Read the config as qspec does and compare the planned tensors with the parameters of the
    Transformer qspec builds from it (on the meta device: no memory), as its loader will."""
    from qspec_core.model.transformer import Transformer

    config = ModelConfig.from_hf_config(hf_config(shape, {}))
    with torch.device("meta"):
        model = Transformer(config)
    want = {
        (k if k == "lm_head.weight" else "model." + k): tuple(v.shape)
        for k, v in model.state_dict().items()
        if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    have = {t.name: t.shape for t in planned}
    if want != have:
        odd = sorted(set(want.items()) ^ set(have.items()))[:4]
        raise AssertionError(f"{shape.name}: qspec expects other tensors ({odd})")
    if shape.arch == "llama" and ROW_GRANULE % config.head_dim:
        raise AssertionError(f"{shape.name}: head_dim must divide {ROW_GRANULE}")
    return config


# ---------------------------------------------------------------------------------------------
# The values


def tensor_seed(name: str) -> int:
    digest = hashlib.sha256(f"{SEED}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # (63 bits: any torch takes it)


def block_rows(shape: tuple[int, ...]) -> int:
    if len(shape) == 1:  # (norms and biases: at most the MLP's width)
        return shape[0]
    return max(ROW_GRANULE, BLOCK_VALUES // shape[1] // ROW_GRANULE * ROW_GRANULE)


class Block:
    """Rows of one tensor: `values` bf16 as generated (the safetensors' bytes), `ggml` the
    float32 the GGUFs quantize (exactly the bf16 values; Llama's q/k rows in llama.cpp's
    order), made once for all the GGUFs."""

    def __init__(self, tensor: Tensor, values: torch.Tensor):
        self.tensor, self.values = tensor, values

    @functools.cached_property
    def ggml(self) -> np.ndarray:
        values = self.values.float().numpy()
        head = self.tensor.rope_head
        if head:
            # per head, row (half, i) goes to (i, half): ggml's RoPE rotates channel pairs
            # (2i, 2i+1) where HF's rotates i with i + head_dim / 2 (the block holds whole heads)
            rows, cols = values.shape
            values = values.reshape(rows // head, 2, head // 2, cols).swapaxes(1, 2)
            values = values.reshape(rows, cols)
        return np.ascontiguousarray(values)


def blocks(t: Tensor) -> Iterator[Block]:
    """`t`'s values, row block by row block: N(0, STD) drawn in float32 from the tensor's own
    generator, rounded to bf16; RMSNorm weights 1."""
    step = block_rows(t.shape)
    gen = torch.Generator().manual_seed(tensor_seed(t.name))
    for start in range(0, t.shape[0], step):
        rows = (min(step, t.shape[0] - start), *t.shape[1:])
        if t.ones:
            values = torch.ones(rows, dtype=torch.bfloat16)
        else:
            values = torch.empty(rows).normal_(0.0, STD, generator=gen).to(torch.bfloat16)
        yield Block(t, values)


# ---------------------------------------------------------------------------------------------
# The tokenizer


@dataclass(frozen=True)
class Tokenizer:
    """SmolLM2-135M-Instruct's: its HF folder (files copied into each HF output) and its
    GGUF's llama.cpp tokenizer metadata (copied into each GGUF), from qspec's model cache."""

    folder: Path
    meta: dict
    token_ids: dict  # bos/eos/pad, from its config.json

    @classmethod
    def find(cls) -> Tokenizer:
        folder = models_dir() / DEFAULT_MODEL.name
        gguf_path = models_dir() / "downloads" / DEFAULT_MODEL.gguf_file
        for path in (folder / "tokenizer.json", folder / "config.json", gguf_path):
            if not path.is_file():
                raise UsageError(
                    f"SmolLM2's tokenizer is not in qspec's model cache (no {path}): run qspec "
                    "once on its default model (e.g. `make demo`), or set QSPEC_HOME"
                )
        try:
            meta = GGUFFile(gguf_path).meta
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            token_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        except (QspecError, OSError, ValueError, KeyError) as e:
            raise UsageError(f"cannot read SmolLM2's tokenizer from {folder}: {e}") from None
        return cls(folder, meta, token_ids)

    @property
    def n_tokens(self) -> int:
        return len(self.meta["tokenizer.ggml.tokens"])

    def add_to(self, w: gguf.GGUFWriter, vocab_size: int) -> None:
        """The vocabulary, `vocab_size` tokens: SmolLM2's, then fillers no text encodes to."""
        meta, filler = self.meta, range(self.n_tokens, vocab_size)
        tokens = [*meta["tokenizer.ggml.tokens"], *(f"[PAD{i}]" for i in filler)]
        if len(set(tokens)) != vocab_size:
            raise AssertionError("a filler token's name is one of SmolLM2's tokens")
        w.add_tokenizer_model(meta["tokenizer.ggml.model"])
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
        w.add_token_list(tokens)
        unused = [int(gguf.TokenType.UNUSED)] * len(filler)
        w.add_token_types([*meta["tokenizer.ggml.token_type"], *unused])
        w.add_token_merges(meta["tokenizer.ggml.merges"])
        setters = {
            "bos_token_id": w.add_bos_token_id,
            "eos_token_id": w.add_eos_token_id,
            "unknown_token_id": w.add_unk_token_id,
            "padding_token_id": w.add_pad_token_id,
            "add_bos_token": w.add_add_bos_token,
            "add_space_prefix": w.add_add_space_prefix,
            "chat_template": w.add_chat_template,
        }
        for key, setter in setters.items():
            if f"tokenizer.ggml.{key}" in meta:
                setter(meta[f"tokenizer.ggml.{key}"])
            elif f"tokenizer.{key}" in meta:  # (tokenizer.chat_template)
                setter(meta[f"tokenizer.{key}"])


# ---------------------------------------------------------------------------------------------
# The outputs


class Output:
    """One file or folder being written: `open` (under a temporary name), then per tensor
    `begin`, `write` each block (returns the bytes written), `end`; then `publish` (rename
    into place) or `discard`. `size`: its bytes once written (known after `open`)."""

    path: Path
    size: int = 0

    @property
    def data_bytes(self) -> int:
        """The tensors' bytes (what the progress counts)."""
        raise NotImplementedError

    def open(self, where: Path) -> None:
        raise NotImplementedError

    def begin(self, t: Tensor) -> None:
        pass

    def write(self, block: Block) -> int:
        raise NotImplementedError

    def end(self, t: Tensor) -> None:
        pass

    def publish(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError

    def parts(self) -> list[tuple[str, int]]:
        """(file name, bytes) of what it writes, for --dry-run."""
        return [(self.path.name, self.size)]


def safetensors_header(shard: list[Tensor]) -> bytes:
    """The header of a bf16 safetensors file holding `shard` in order: its length (u64, little
    endian), then JSON padded with spaces to a multiple of 8 bytes (the data stays aligned)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        end = offset + 2 * t.numel
        header[t.name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def plan_shards(planned: list[Tensor]) -> list[list[Tensor]]:
    """Tensors in order, a new shard whenever the next would take one past SHARD_BYTES."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in planned:
        if shards[-1] and size + 2 * t.numel > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += 2 * t.numel
    return shards


def _fsync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


class HFFolder(Output):
    """The Hugging Face folder, written in a temporary sibling folder renamed into place."""

    def __init__(self, shape: Shape, planned: list[Tensor], path: Path, tok: Tokenizer):
        self.shape, self.path, self.tok = shape, path, tok
        self.shards = plan_shards(planned)
        n = len(self.shards)
        self.names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        self.headers = [safetensors_header(shard) for shard in self.shards]
        self.shard_of = {shard[0].name: i for i, shard in enumerate(self.shards)}
        self.shard_bytes = [
            len(h) + sum(2 * t.numel for t in s)
            for h, s in zip(self.headers, self.shards, strict=True)
        ]
        self.small: dict[str, bytes] = {}  # the other files, made by `open`
        self.tmp: Path | None = None
        self.file = None

    def _small_files(self) -> dict[str, bytes]:
        def as_json(data: dict) -> bytes:
            return (json.dumps(data, indent=2) + "\n").encode()

        files = {"config.json": as_json(hf_config(self.shape, self.tok.token_ids))}
        generation = self.tok.folder / "generation_config.json"
        if generation.is_file():
            files["generation_config.json"] = generation.read_bytes()
        for name in TOKENIZER_FILES:
            if (self.tok.folder / name).is_file():
                files[name] = (self.tok.folder / name).read_bytes()
        if len(self.shards) > 1:
            weight_map = {
                t.name: name for name, s in zip(self.names, self.shards, strict=True) for t in s
            }
            total = sum(2 * t.numel for s in self.shards for t in s)
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            files["model.safetensors.index.json"] = as_json(index)
        files["README.md"] = (
            f"# {self.path.name}\n\nRandom weights (N(0, {STD}) from seed {SEED}, RMSNorm "
            f"weights 1) in the shape of {self.shape.mirrors}, with SmolLM2-135M-Instruct's "
            f"tokenizer (it produces ids below {self.tok.n_tokens}). For measuring time and "
            "memory only: what it generates is noise. Written by qspec's "
            "benchmarks/shapes.py.\n"
        ).encode()
        return files

    def open(self, where: Path) -> None:
        self.small = self._small_files()
        self.size = sum(self.shard_bytes) + sum(map(len, self.small.values()))
        self.tmp = temp_path(where / self.path.name)
        self.tmp.mkdir(parents=True)
        for name, data in self.small.items():
            (self.tmp / name).write_bytes(data)

    @property
    def data_bytes(self) -> int:
        return sum(2 * t.numel for s in self.shards for t in s)

    def begin(self, t: Tensor) -> None:
        if t.name in self.shard_of:
            self._close_shard()
            i = self.shard_of[t.name]
            self.file = open(
                self.tmp / self.names[i], "wb"
            )  # (closed by the next shard or publish)
            self.file.write(self.headers[i])

    def write(self, block: Block) -> int:
        data = block.values.view(torch.int16).numpy()  # the bf16 bits, little-endian
        self.file.write(data)
        return data.nbytes

    def _close_shard(self) -> None:
        if self.file is not None:
            _fsync_close(self.file)
            self.file = None

    def publish(self) -> None:
        self._close_shard()
        for name, size in zip(self.names, self.shard_bytes, strict=True):
            if (self.tmp / name).stat().st_size != size:
                raise AssertionError(
                    f"{name}: {(self.tmp / name).stat().st_size} bytes, not {size}"
                )
        old = None
        if self.path.exists():  # (--force) a folder cannot be renamed over a full one
            old = temp_path(self.path)
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        self.tmp = None
        if old is not None:
            shutil.rmtree(old)

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def parts(self) -> list[tuple[str, int]]:
        small = [(f"{self.path.name}/{n}", len(d)) for n, d in self.small.items()]
        shards = [
            (f"{self.path.name}/{n}", b) for n, b in zip(self.names, self.shard_bytes, strict=True)
        ]
        return [(self.path.name + "/", self.size), *shards, *small]


class GGUFOutput(Output):
    """A GGUF of one quantization type: the metadata and tensor table first, then the data."""

    def __init__(self, shape: Shape, planned: list[Tensor], path: Path, kind: str, tok: Tokenizer):
        self.shape, self.planned, self.path, self.tok = shape, planned, path, tok
        self.qtype, self.ftype = GGUF_TYPES[kind]
        self.rope_factors = rope_freq_factors(shape.config)
        self.writer: gguf.GGUFWriter | None = None
        self.tmp: Path | None = None

    def _table(self) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]]:
        """(name, shape, type, bytes) of every tensor in file order."""
        table = []
        if self.rope_factors is not None:  # (not in the HF folder: llama.cpp's own tensor)
            factors = self.rope_factors
            table.append(
                ("rope_freqs.weight", factors.shape, GGMLQuantizationType.F32, factors.nbytes)
            )
        for t in self.planned:
            table.append((t.gguf_name, t.shape, t.gguf_type(self.qtype), t.gguf_bytes(self.qtype)))
        return table

    def open(self, where: Path) -> None:
        c, d = self.shape.config, self.shape.config["head_dim"]
        where.mkdir(parents=True, exist_ok=True)
        self.tmp = temp_path(where / self.path.name)
        w = self.writer = gguf.GGUFWriter(self.tmp, arch=self.shape.arch)
        w.add_type("model")
        w.add_name(f"{self.shape.name}-random")
        w.add_description(
            f"random weights (seed {SEED}) in the shape of {self.shape.mirrors}, with "
            "SmolLM2-135M-Instruct's tokenizer: for measuring time and memory only"
        )
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(c["hidden_size"])
        w.add_block_count(c["num_hidden_layers"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(d)
        w.add_value_length(d)
        w.add_rope_dimension_count(d)
        w.add_rope_freq_base(c["rope_theta"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_vocab_size(c["vocab_size"])
        w.add_file_type(self.ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        self.tok.add_to(w, c["vocab_size"])
        table = self._table()
        for name, shape, qtype, nbytes in table:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())  # the data starts aligned, each tensor too
        pad = w.data_alignment
        self.size = fout.tell() + sum(gguf.GGUFWriter.ggml_pad(row[3], pad) for row in table)
        if self.rope_factors is not None:
            fout.write(self.rope_factors.tobytes())
            w.write_padding(fout, self.rope_factors.nbytes)

    @property
    def data_bytes(self) -> int:
        return sum(t.gguf_bytes(self.qtype) for t in self.planned)

    def write(self, block: Block) -> int:
        data = gguf.quants.quantize(block.ggml, block.tensor.gguf_type(self.qtype))
        self.writer.fout[0].write(np.ascontiguousarray(data))
        return data.nbytes

    def end(self, t: Tensor) -> None:
        self.writer.write_padding(self.writer.fout[0], t.gguf_bytes(self.qtype))

    def publish(self) -> None:
        fout = self.writer.fout[0]
        if fout.tell() != self.size:
            raise AssertionError(f"{self.path.name}: {fout.tell()} bytes, not {self.size}")
        _fsync_close(fout)
        self.writer.fout = None
        os.replace(self.tmp, self.path)
        self.tmp = None

    def discard(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


# ---------------------------------------------------------------------------------------------
# Planning and writing


@dataclass
class Plan:
    shape: Shape
    tensors: list[Tensor]
    config: ModelConfig  # as qspec reads it
    write: list[Output]
    kept: list[Path]


def plan(shape: Shape, out: Path, kinds: list[str], force: bool, tok: Tokenizer) -> Plan:
    planned = tensors(shape)
    config = check_with_qspec(shape, planned)
    stem = out / f"{shape.name}-random"
    outputs: list[Output] = [HFFolder(shape, planned, stem, tok)]
    for kind in kinds:
        path = stem.with_name(f"{stem.name}.{kind.upper()}.gguf")
        outputs.append(GGUFOutput(shape, planned, path, kind, tok))
    for o in outputs:
        if o.path.exists() and not (o.path.is_dir() == isinstance(o, HFFolder)):
            kind = "file" if isinstance(o, HFFolder) else "folder"
            raise UsageError(f"{o.path} is a {kind}; move it away")
    write = [o for o in outputs if force or not o.path.exists()]
    kept = [o.path for o in outputs if o not in write]
    return Plan(shape, planned, config, write, kept)


def describe(p: Plan) -> str:
    c, q = p.shape.config, p.config
    rope = (
        q.rope_type if q.rope_type == "default" else f"{q.rope_type} x{q.rope_scaling['factor']:g}"
    )
    return (
        f"{p.shape.name} ({p.shape.mirrors}): {sum(t.numel for t in p.tensors):,} parameters, "
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, heads {c['num_attention_heads']}/"
        f"{c['num_key_value_heads']} x {q.head_dim}, vocab {c['vocab_size']}, "
        f"{'tied' if q.tie_word_embeddings else 'untied'}, RoPE {rope} "
        f"(theta {q.rope_theta:g})"
    )


class Progress:
    """A rich bar of the bytes written when stderr is a terminal, else a line per tensor."""

    def __init__(self, total: int, n_tensors: int):
        self.total, self.n, self.done, self.started = total, n_tensors, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description:<40}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def tensor(self, i: int, t: Tensor) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"[{i}/{self.n}] {t.name}")

    def wrote(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, advance=nbytes)

    def tensor_done(self, i: int, t: Tensor) -> None:
        if self.bar is None:
            shape = "x".join(map(str, t.shape))
            print(
                f"  [{i:>3}/{self.n}] {t.name:<46} {shape:>12}  "
                f"{self.done / GB:6.2f}/{self.total / GB:.2f} GB  "
                f"{time.perf_counter() - self.started:5.0f} s",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def generate(p: Plan) -> None:
    """Write every output of `p.write` in one pass over the tensors, then publish them all;
    on any failure (Ctrl-C included) remove what was written."""
    try:
        for o in p.write:
            o.open(o.path.parent)
        free = shutil.disk_usage(p.write[0].path.parent).free
        need = sum(o.size for o in p.write)
        if need > free:
            raise UsageError(
                f"{p.shape.name} needs {need / GB:.1f} GB, {free / GB:.1f} GB are free in "
                f"{p.write[0].path.parent}"
            )
        progress = Progress(sum(o.data_bytes for o in p.write), len(p.tensors))
        try:
            for i, t in enumerate(p.tensors, 1):
                progress.tensor(i, t)
                for o in p.write:
                    o.begin(t)
                for block in blocks(t):
                    for o in p.write:
                        progress.wrote(o.write(block))
                for o in p.write:
                    o.end(t)
                progress.tensor_done(i, t)
        finally:
            progress.close()
        for o in p.write:
            o.publish()
    finally:
        for o in p.write:
            o.discard()


def dry_run(p: Plan) -> None:
    """The planned files and their sizes, headers included: each output opened (its metadata
    written) in a temporary folder, then discarded."""
    with tempfile.TemporaryDirectory(prefix="shapes-dry-run-") as where:
        for o in p.write:
            try:
                o.open(Path(where))
                for name, size in o.parts():
                    path = os.path.join(o.path.parent, name)  # (a folder's keeps its "/")
                    print(f"  write {path}  {size:,} bytes ({size / GB:.2f} GB)")
            finally:
                o.discard()
    for path in p.kept:
        print(f"  keep  {path} (exists; --force rewrites it)")


def list_shapes() -> None:
    print(f"{'shape':<14} {'mirrors':<34} {'parameters':>15} {'bf16':>9} {'Q8_0':>9} {'Q4_0':>9}")
    for shape in SHAPES.values():
        planned = tensors(shape)
        n = sum(t.numel for t in planned)
        sizes = [2 * n] + [sum(t.gguf_bytes(q) for t in planned) for q, _ in GGUF_TYPES.values()]
        gb = " ".join(f"{s / GB:>6.2f} GB" for s in sizes)
        print(f"{shape.name:<14} {shape.mirrors:<34} {n:>15,} {gb}")
    print("(bytes: the weights alone, 1 GB = 10^9 bytes)")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(
        description="\n\n".join(__doc__.split("\n\n")[:5]),
        epilog=f"shapes: {', '.join(SHAPES)}; how the weights are made: the module docstring",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("shapes", nargs="*", metavar="SHAPE", help="shapes to write (see --list)")
    ap.add_argument("--list", action="store_true", help="list the shapes with their sizes")
    ap.add_argument(
        "-o", "--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)"
    )
    ap.add_argument(
        "--gguf",
        default="q8_0,q4_0",
        help="GGUF types to write, comma-separated, of q8_0,q4_0; 'none': no GGUF "
        "(default: %(default)s)",
    )
    ap.add_argument("--force", action="store_true", help="rewrite outputs that exist")
    ap.add_argument("--dry-run", action="store_true", help="print the planned files and sizes")
    args = ap.parse_args(argv)
    if not args.list and not args.shapes:
        ap.error("name a shape (--list lists them)")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r} (have: {', '.join(SHAPES)})")
    kinds = [k.strip().lower() for k in args.gguf.split(",") if k.strip()]
    if kinds == ["none"]:
        kinds = []
    bad = [k for k in kinds if k not in GGUF_TYPES]
    if bad or len(set(kinds)) != len(kinds):
        ap.error(f"--gguf takes some of {','.join(GGUF_TYPES)} or 'none', not {args.gguf!r}")
    args.gguf = kinds
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is not a folder")
    return args


def _terminated(signum, frame):
    raise KeyboardInterrupt  # (so that the temporary files are removed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_shapes()
        return 0
    signal.signal(signal.SIGTERM, _terminated)
    started = time.perf_counter()
    try:
        tok = Tokenizer.find()
        plans = [plan(SHAPES[s], args.out, args.gguf, args.force, tok) for s in args.shapes]
        for p in plans:
            print(describe(p), flush=True)
            if args.dry_run:
                dry_run(p)
                continue
            for path in p.kept:
                print(f"  kept {path} (exists; --force rewrites it)")
            if p.write:
                generate(p)
                for o in p.write:
                    print(f"  wrote {o.path} ({o.size / GB:.2f} GB)", flush=True)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the outputs being written were removed", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (Linux: KiB)
    print(f"done in {time.perf_counter() - started:.0f} s; peak RSS {peak:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
