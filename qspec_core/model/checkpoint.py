"""Load a Hugging Face checkpoint folder (single or sharded safetensors) into `Transformer`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qspec_core.config import ConfigError, ModelConfig
from qspec_core.errors import QspecError
from qspec_core.families import family_for
from qspec_core.model.rope import RotaryEmbedding
from qspec_core.model.transformer import Transformer, local_rope_config

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in shard order."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
                raise ValueError("weight_map must map tensor names to shard file names")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # ValueError covers bad JSON and UTF-8; TypeError/AttributeError a wrong shape
            raise QspecError(f"corrupt checkpoint index {index}: {e}") from None
        return [folder / name for name in names]
    # draft.safetensors holds a converted model's 4-bit draft, loaded separately
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != "draft.safetensors")
    if not files:
        raise QspecError(f"no *.safetensors weights in {folder}")
    return files


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """HF tensor names with the `model.` prefix stripped (the key filter of style.md)."""
    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        if not path.exists():
            raise QspecError(f"checkpoint shard {path} is missing")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    state[name.removeprefix("model.")] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise QspecError(f"corrupt checkpoint {path}: {e}") from None
    return state


# safetensors dtype names -> torch dtypes (the ones checkpoints hold)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
MAX_HEADER = 100 << 20  # bytes: a larger safetensors header is a damaged file


class CheckpointReader:
    """A checkpoint's tensors by HF name (`model.` stripped), read one at a time: what a
    layer-by-layer conversion holds is the tensors it asked for, not the model. Plain reads
    at the offsets the safetensors headers give, not a memory map: a mapped file's pages count
    in the process's resident memory once touched, so reading a whole 16 GB checkpoint
    through one would leave 16 GB resident. `shapes` lists every tensor's shape."""

    def __init__(self, folder: Path):
        self._where: dict[str, tuple[Path, int, int, torch.dtype]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in checkpoint_files(folder):
            if not path.exists():
                raise QspecError(f"checkpoint shard {path} is missing")
            for name, (start, end, dtype, shape) in _header(path).items():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                key = name.removeprefix("model.")
                self._where[key] = (path, start, end, dtype)
                self.shapes[key] = shape

    def _read(self, path: Path, start: int, size: int) -> bytearray:
        buf = bytearray(size)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                if f.readinto(buf) != size:
                    raise OSError("the file ends inside a tensor")
        except OSError as e:
            raise QspecError(f"corrupt checkpoint {path}: {e}") from None
        return buf

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor `name`, cast to `dtype`."""
        return self.rows(name, 0, self.shapes[name][0] if self.shapes[name] else 1, dtype)

    def rows(self, name: str, start: int, end: int, dtype=torch.float32) -> torch.Tensor:
        """Rows [start, end) of the tensor `name` (its first dimension), cast to `dtype`."""
        path, first, _, stored = self._where[name]
        shape = self.shapes[name]
        row = stored.itemsize * (math.prod(shape[1:]) if shape else 1)
        buf = self._read(path, first + start * row, (end - start) * row)
        if not buf:
            return torch.empty((end - start, *shape[1:]), dtype=dtype)
        t = torch.frombuffer(buf, dtype=stored).reshape((end - start, *shape[1:]) if shape else ())
        return t.to(dtype)

    def state(self, prefix: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with `prefix` ("layers.3."), names kept whole."""
        return {n: self.get(n, dtype) for n in self._where if n.startswith(prefix)}


def _header(path: Path) -> dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]:
    """name -> (first byte, end byte, dtype, shape) of every tensor in a safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < size <= MAX_HEADER:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(size))
            data = 8 + size
            file_size = f.seek(0, 2)
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = (data + int(o) for o in entry["data_offsets"])
            dtype, shape = _DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"])
            if end > file_size or end - start != dtype.itemsize * math.prod(shape):
                raise ValueError(f"tensor {name} does not fit its offsets")
            out[name] = (start, end, dtype, shape)
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise QspecError(f"corrupt checkpoint {path}: {e}") from None


def check_layer_count(config: ModelConfig, names) -> None:
    """The decoder layers the tensor names `names` ("layers.7.mlp.up_proj.weight", ...) hold
    against config.json's num_hidden_layers, before a model of that many layers is built (a
    config of 10^9 layers would allocate for minutes)."""
    held = {int(n.split(".")[1]) for n in names if n.startswith("layers.") and
            n.split(".")[1].isdigit()}  # fmt: skip
    n = config.num_hidden_layers
    if len(held) != n or (held and (min(held), max(held)) != (0, n - 1)):  # (0 .. n - 1)
        raise QspecError(
            f"checkpoint does not match its config.json: it holds {len(held)} decoder layers, "
            f"config.json says num_hidden_layers {config.num_hidden_layers}"
        )


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Instantiate without random init and assign the checkpoint tensors, cast to `dtype`."""
    check_layer_count(config, state)
    with torch.device("meta"):
        model = Transformer(config)
    family = family_for(config.model_type)
    if family is not None and family.fused:
        state = split_fused(state, family.fused, model)
    expected = set(model.state_dict().keys())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state = {k: t for k, t in state.items() if k != "lm_head.weight"}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise QspecError(
            "checkpoint does not match its config.json: "
            f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    for name, tensor in state.items():
        want = model.get_parameter(name).shape
        if tensor.shape != want:
            raise QspecError(
                f"checkpoint tensor {name} has shape {list(tensor.shape)}, "
                f"config.json implies {list(want)}"
            )
    state = {k: t.to(device=device, dtype=dtype) for k, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary_emb = model.rotary_emb.__class__(config).to(device)  # real buffers, not meta
    if config.layer.local_rope:
        model.local_rotary_emb = RotaryEmbedding(local_rope_config(config)).to(device)
    return model.eval().requires_grad_(False)


def split_fused(state: dict, fused, model: Transformer) -> dict[str, torch.Tensor]:
    """A checkpoint's fused linears (Phi-3's `qkv_proj`, `gate_up_proj`) as the separate ones
    the model has: rows split in the parts' sizes, in order. A fused tensor whose parts the
    model lacks or whose rows do not add up is left for `build_model` to refuse."""
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    state = dict(state)
    for name in list(state):
        module, _, kind = name.rpartition(".")  # "layers.0.self_attn.qkv_proj", "weight"
        for whole, parts in fused:
            if not module.endswith("." + whole):
                continue
            prefix = module[: -len(whole)]  # "layers.0."
            names = [f"{prefix}{part}.{kind}" for part in parts]
            if not all(n in shapes for n in names):
                continue
            sizes = [shapes[n][0] for n in names]
            if sum(sizes) != state[name].shape[0]:
                raise QspecError(
                    f"checkpoint tensor {name} has {state[name].shape[0]} rows, config.json "
                    f"implies {sum(sizes)} ({' + '.join(map(str, sizes))})"
                )
            fused_tensor = state.pop(name)
            for n, part in zip(names, fused_tensor.split(sizes), strict=True):
                state[n] = part.clone()  # (its own storage: the fused tensor can be freed)
    return state


def load_model(folder: Path, dtype=torch.bfloat16, device="cpu") -> Transformer:
    """Read `config.json` and the weights of a local HF folder (a converted folder's 4-bit and
    INT8 twins are attached by `convert.folder.load_converted`)."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise QspecError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = ModelConfig.from_file(config_path)
    except ConfigError as e:
        raise QspecError(f"corrupt {config_path}: {e}") from None
    return build_model(config, load_state_dict(folder), dtype=dtype, device=device)
