"""Load a Hugging Face checkpoint folder (single or sharded safetensors) into `Transformer`."""

from __future__ import annotations

import json
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


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Instantiate without random init and assign the checkpoint tensors, cast to `dtype`."""
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
