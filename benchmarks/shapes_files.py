"""The files `shapes.py` writes, tensor by tensor: the values of each tensor (seeded by its
name, generated in blocks), the tokenizer taken from SmolLM2, the HF folder (streamed
safetensors shards) and the GGUFs."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from shapes_table import (
    BLOCK_VALUES,
    GGUF_TYPES,
    ROW_GRANULE,
    SEED,
    SHARD_BYTES,
    STD,
    TOKENIZER_FILES,
    Shape,
    Tensor,
    UsageError,
    hf_config,
    rope_freq_factors,
)

from qspec_core.atomic_write import temp_path
from qspec_core.errors import QspecError
from qspec_core.paths import models_dir
from qspec_core.registry.gguf_file import GGUFFile
from qspec_core.registry.sources import DEFAULT_MODEL


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
