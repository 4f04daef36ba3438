"""Load a Hugging Face checkpoint folder (single or sharded safetensors) into `Transformer`."""

from __future__ import annotations

import json
import math
import mmap
import warnings
from pathlib import Path

import torch

from qspec_core.config import ConfigError, ModelConfig
from qspec_core.errors import QspecError
from qspec_core.families import family_for
from qspec_core.model.rope import RotaryEmbedding
from qspec_core.model.transformer import Transformer, linear_layers, local_rope_config

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LINEAR = ("weight", "bias")  # a linear's tensors


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


def load_state_dict(
    folder: Path, dtype: torch.dtype | None = None, skip=(), as_stored=(), mapped=()
) -> dict[str, torch.Tensor]:
    """HF tensor names with the `model.` prefix stripped (the key filter of style.md), each
    cast to `dtype` as it is read (None: as stored); tensors named in `skip` are not read,
    those in `as_stored` are read in the checkpoint's dtype, those in `mapped` memory-mapped
    as stored (`TensorFile.mapped`)."""
    reader = CheckpointReader(folder)
    return {
        n: reader.mapped(n) if n in mapped else reader.get(n, None if n in as_stored else dtype)
        for n in reader.shapes
        if n not in skip
    }


# safetensors dtype names -> torch dtypes (the ones checkpoints hold)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
EMBEDDING = "embed_tokens.weight"
MAX_HEADER = 100 << 20  # bytes: a larger safetensors header is a damaged file


class TensorFile:
    """One safetensors file, its tensors read by plain reads at the offsets its header gives,
    not through a memory map: a mapped file's pages count in the process's resident memory
    once touched, so a 16 GB checkpoint read through one would stay 16 GB resident beside the
    copies made of it. `keys()` and `get_tensor(name)` as safetensors' `safe_open` has them."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = _header(self.path)  # name -> (first byte, end byte, dtype, shape)

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][3]

    def get_tensor(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The tensor `name` as stored, or rows [start, end) of its first dimension."""
        first, _, dtype, shape = self.entries[name]
        if not shape:
            return self._tensor(first, dtype.itemsize, dtype).reshape(())
        end = shape[0] if end is None else end
        row = dtype.itemsize * math.prod(shape[1:])
        return self._tensor(first + start * row, (end - start) * row, dtype).reshape(
            end - start, *shape[1:]
        )

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored, through a private memory map: only the pages a reader
        touches become resident (an embedding table read by rows: the rows of the tokens
        seen). Read-only in use; copy on write, so the file never changes."""
        first, end, dtype, shape = self.entries[name]
        if end == first:
            return self.get_tensor(name)
        try:
            with open(self.path, "rb") as f:
                view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise QspecError(f"corrupt checkpoint {self.path}: {e}") from None
        with warnings.catch_warnings():  # (a copy-on-write map is writable: no warning due)
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=first)
        return flat.reshape(shape)

    def _tensor(self, offset: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        buf = bytearray(size)
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                if f.readinto(buf) != size:
                    raise OSError("the file ends inside a tensor")
        except OSError as e:
            raise QspecError(f"corrupt checkpoint {self.path}: {e}") from None
        return torch.frombuffer(buf, dtype=dtype) if size else torch.empty(0, dtype=dtype)


class CheckpointReader:
    """A checkpoint's tensors by HF name (`model.` stripped), read one at a time from its
    shards (`TensorFile`): a layer-by-layer conversion holds the tensors it asked for, not the
    model. `shapes` lists every tensor's shape, read from the headers."""

    def __init__(self, folder: Path):
        self._where: dict[str, tuple[TensorFile, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in checkpoint_files(folder):
            if not path.exists():
                raise QspecError(f"checkpoint shard {path} is missing")
            shard = TensorFile(path)
            for name in shard.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                key = name.removeprefix("model.")
                self._where[key] = (shard, name)
                self.shapes[key] = shard.shape(name)

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor `name`, cast to `dtype` (None: as stored)."""
        shard, stored = self._where[name]
        t = shard.get_tensor(stored)
        return t if dtype is None else t.to(dtype)

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored, memory-mapped (`TensorFile.mapped`)."""
        shard, stored = self._where[name]
        return shard.mapped(stored)

    def rows(self, name: str, start: int, end: int, dtype=torch.float32) -> torch.Tensor:
        """Rows [start, end) of the tensor `name` (its first dimension), cast to `dtype`."""
        shard, stored = self._where[name]
        return shard.get_tensor(stored, start, end).to(dtype)

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
    skipped=(),
    bf16_held: bool = False,
) -> Transformer:
    """Instantiate without random init and assign the checkpoint tensors, cast to `dtype`.
    `skipped`: linears whose weights (and biases) the caller left out of `state`, on purpose
    (`load_model`): they stay on the meta device, and the model has no "full" weight set.
    With lm_head among them, the embedding table is only ever read by rows (`embed`): it
    stays in the checkpoint's dtype where that is narrower (bf16: half an fp32 table; 0.5 GB
    at Llama 3's vocabulary and 2,048 wide), its rows cast as they are read, exactly.
    `bf16_held`: the linears' bf16 weights (and the embedding table) stay bf16 under an fp32
    `dtype`, and every product upcasts them exactly (`Linear.forward`, the runner's kernels,
    which read bf16 rows directly): half the bytes held, the same numbers computed. The
    runner says where its kernels do so (`kernel_table.holds_bf16`)."""
    check_layer_count(config, [*state, *(f"{m}.weight" for m in skipped)])
    with torch.device("meta"):
        model = Transformer(config)
    family = family_for(config.model_type)
    if family is not None and family.fused:
        state = split_fused(state, family.fused, model)
    expected = set(model.state_dict().keys()) - {f"{m}.{k}" for m in skipped for k in LINEAR}
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
    narrow = {EMBEDDING} if "lm_head" in skipped else set()
    if bf16_held and dtype == torch.float32:
        narrow = {EMBEDDING} | {f"{m}.weight" for m in linear_layers(model)}
    state = {
        k: t.to(device) if k in narrow and _narrower(t.dtype, dtype, bf16_held) else
        t.to(device=device, dtype=dtype)
        for k, t in state.items()
    }  # fmt: skip
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary_emb = model.rotary_emb.__class__(config).to(device)  # real buffers, not meta
    if config.layer.local_rope:
        model.local_rotary_emb = RotaryEmbedding(local_rope_config(config)).to(device)
    if skipped:
        model.weight_sets.discard("full")
    return model.eval().requires_grad_(False)


def _narrower(stored: torch.dtype, dtype: torch.dtype, bf16_only: bool) -> bool:
    """Whether a tensor stored as `stored` is kept so under the model's `dtype`."""
    return stored == torch.bfloat16 if bf16_only else stored.itemsize <= dtype.itemsize


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


def load_model(
    folder: Path, dtype=torch.bfloat16, device="cpu", skip=(), bf16_held: bool = False
) -> Transformer:
    """Read `config.json` and the weights of a local HF folder (a converted folder's 4-bit and
    INT8 twins are attached by `convert.folder.load_converted`). `skip`: linears (HF names)
    whose weights a run does not need and are not read (`build_model`'s `skipped`);
    `bf16_held`: `build_model`'s."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise QspecError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = ModelConfig.from_file(config_path)
    except ConfigError as e:
        raise QspecError(f"corrupt {config_path}: {e}") from None
    tied = config.tie_word_embeddings  # (lm_head's weight is the embedding's: it is read)
    names = {f"{m}.{k}" for m in skip for k in LINEAR if not (m == "lm_head" and tied)}
    as_stored = {EMBEDDING} if "lm_head" in skip or bf16_held else set()
    if bf16_held:  # (read as stored; build_model keeps the bf16 ones, casts the rest)
        as_stored |= {n for n in CheckpointReader(folder).shapes if n.endswith(".weight")}
    # read by rows only, where lm_head's weight is not: mapped, the rows of the tokens seen
    # resident (Llama 3.1 8B's table is 1 GB in bf16), not the whole table
    mapped = {EMBEDDING} if "lm_head" in skip else set()
    state = load_state_dict(folder, dtype, names, as_stored, mapped)
    return build_model(config, state, dtype, device, skip, bf16_held)
