"""GPTQ / AWQ checkpoint packing, unpacking and folder I/O against hand-computed bit layouts."""

import json

import pytest
import torch
from safetensors.torch import save_file

from qspec_core.convert.formats import (
    AWQ_PACK_ORDER,
    AWQ_UNPACK_ORDER,
    Int4Weight,
    has_trivial_g_idx,
    pack_awq,
    pack_gptq,
    read_quantized_checkpoint,
    unpack_awq,
    unpack_gptq,
    write_gptq_checkpoint,
)
from qspec_core.errors import QspecError


def i32(word: int) -> int:
    """A 32-bit pattern written in hex -> the signed int32 value the checkpoint stores."""
    return word - 2**32 if word >= 2**31 else word


def words(*hex_words: int) -> torch.Tensor:
    return torch.tensor([i32(w) for w in hex_words], dtype=torch.int32)


def random_weight(n, k, group_size, sym=False, g_idx=None, seed=0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    n_groups = k // group_size
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if sym:
        zero = torch.full((n, n_groups), 8.0)
    else:
        zero = torch.randint(0, 16, (n, n_groups), generator=gen).float()
        zero[0, 0] = 0.0  # the v1 corner case (stored zero - 1 underflows) always appears
    # fp16-representable scales, so the fp16 checkpoint round trip is exact
    scale = (torch.rand(n, n_groups, generator=gen) * 0.1 + 1e-3).half().float()
    return Int4Weight(q=q, scale=scale, zero=zero, group_size=group_size, g_idx=g_idx)


def assert_same(a: Int4Weight, b: Int4Weight):
    assert a.group_size == b.group_size
    assert torch.equal(a.q, b.q)
    assert torch.equal(a.scale, b.scale)
    assert torch.equal(a.zero, b.zero)
    assert (a.g_idx is None) == (b.g_idx is None)
    if a.g_idx is not None:
        assert torch.equal(a.g_idx.long(), b.g_idx.long())


def act_order_g_idx(k: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """g_idx as GPTQ writes it with desc_act: columns are quantized in order `perm` (by
    descending activation), so channel perm[i] is the i-th quantized and joins group
    i // group_size; channel k therefore uses group argsort(perm)[k] // group_size."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    return (torch.argsort(perm) // group_size).to(torch.int32)


# ---- hand-computed bit layouts ----------------------------------------------------------------

# A tiny 8x8 linear (N=8 out, K=8 in, one group of 8) with q[n, k] = n + k.
Q_FIXTURE = (torch.arange(8)[:, None] + torch.arange(8)[None, :]).to(torch.uint8)  # [N, K]


def test_gptq_fixture_bytes():
    # GPTQ packs along the input dim: qweight[0, n] holds q[n, 0..7], q[n, k] at bits 4k.
    # Read as hex (highest nibble first) the word of column n is the digits n+7 ... n+0.
    # Columns 1..7 have the top bit set, so they are negative int32 values.
    qweight = words(
        0x76543210, 0x87654321, 0x98765432, 0xA9876543,
        0xBA987654, 0xCBA98765, 0xDCBA9876, 0xEDCBA987,
    )[None, :]  # fmt: skip  # [K/8 = 1, N = 8]
    # qzeros packs along the output dim: zero of column n at bits 4n. True zeros 1..8:
    # gptq_v2 stores them as-is, gptq (v1) stores zero - 1 = 0..7.
    zero = torch.arange(1, 9).float()[:, None]  # [N, 1]
    qzeros_v2 = words(0x87654321)[None, :]  # [n_groups = 1, N/8 = 1]
    qzeros_v1 = words(0x76543210)[None, :]
    scales = torch.linspace(0.5, 4.0, 8).half()[None, :]  # [1, N]
    g_idx = torch.zeros(8, dtype=torch.int32)

    w = Int4Weight(q=Q_FIXTURE, scale=scales.t().float(), zero=zero, group_size=8)
    for fmt, qzeros in (("gptq_v2", qzeros_v2), ("gptq", qzeros_v1)):
        packed = pack_gptq(w, fmt)
        assert torch.equal(packed["qweight"], qweight)
        assert torch.equal(packed["qzeros"], qzeros)
        assert torch.equal(packed["scales"], scales)
        assert torch.equal(packed["g_idx"], g_idx)
        assert_same(unpack_gptq(qweight, qzeros, scales, g_idx, 4, 8, False, fmt), w)


def test_gptq_v1_zero_point_zero_borrows_like_gptqmodel():
    # True zeros 0..7 are the v2 word 0x76543210. v1 subtracts 0x11111111 from the whole word
    # (GPTQModel's v2 -> v1): nibble 0 is 0 - 1 = 0xF and borrows, so nibble 1 is 1 - 1 - 1 =
    # 0xF, nibble 2 is 2 - 1 - 1 = 0, and the rest are z - 1: 0x654320FF.
    zero = torch.arange(8).float()[:, None]
    w = Int4Weight(Q_FIXTURE, torch.ones(8, 1), zero, group_size=8)
    packed = pack_gptq(w, "gptq")
    assert torch.equal(packed["qzeros"], words(0x654320FF)[None, :])
    back = unpack_gptq(**packed, bits=4, group_size=8, sym=False, checkpoint_format="gptq")
    assert torch.equal(back.zero, zero)


def test_awq_fixture_bytes():
    # AWQ packs along the output dim: qweight[k, 0] holds q[0..7, k], and bits 4j hold output
    # column AWQ_PACK_ORDER[j] = (0, 2, 4, 6, 1, 3, 5, 7)[j]. With q[n, k] = n + k, nibbles
    # j = 0..7 of row k are (0, 2, 4, 6, 1, 3, 5, 7) + k; in hex, highest nibble first, row 0
    # reads 7 5 3 1 6 4 2 0.
    qweight = words(
        0x75316420, 0x86427531, 0x97538642, 0xA8649753,
        0xB975A864, 0xCA86B975, 0xDB97CA86, 0xECA8DB97,
    )[:, None]  # fmt: skip  # [K = 8, N/8 = 1]
    zero = torch.arange(8).float()[:, None]  # zero of output column n is n, stored as-is
    qzeros = words(0x75316420)[None, :]  # [K/g = 1, N/8 = 1]
    scales = torch.linspace(0.5, 4.0, 8).half()[None, :]  # [K/g, N]

    w = Int4Weight(q=Q_FIXTURE, scale=scales.t().float(), zero=zero, group_size=8)
    packed = pack_awq(w)
    assert torch.equal(packed["qweight"], qweight)
    assert torch.equal(packed["qzeros"], qzeros)
    assert torch.equal(packed["scales"], scales)
    assert_same(unpack_awq(qweight, qzeros, scales, group_size=8), w)


def test_awq_orders_and_autoawq_style_unpack():
    assert [AWQ_PACK_ORDER[c] for c in AWQ_UNPACK_ORDER] == list(range(8))
    w = random_weight(32, 64, 32, seed=3)
    packed = pack_awq(w)
    # AutoAWQ's published unpack: shift out nibbles in storage order, then gather each block
    # of 8 with the reverse order [0, 4, 1, 5, 2, 6, 3, 7].
    shifts = torch.arange(0, 32, 4)
    raw = (packed["qweight"][:, :, None].long() >> shifts) & 0xF  # [K, N/8, 8]
    reverse = torch.arange(raw.shape[1] * 8).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    logical = raw.view(raw.shape[0], -1)[:, reverse]  # [K, N]
    assert torch.equal(logical.t().to(torch.uint8), w.q)
    assert_same(unpack_awq(**packed, group_size=32), w)


def test_unpack_negative_words():
    # 0xFFFFFFFF (-1) is eight 15s; 0x80000000 (int32 min) has only nibble 7 = 8;
    # 0xF0000001 has nibble 0 = 1 and nibble 7 = 15.
    qweight = words(0xFFFFFFFF, 0x80000000, 0xF0000001, 0, 0, 0, 0, 0)[None, :]  # [1, 8]
    qzeros = words(0xFFFFFFFF)[None, :]
    scales = torch.ones(1, 8).half()
    w = unpack_gptq(qweight, qzeros, scales, None, 4, 8, False, "gptq_v2")
    assert w.q[0].tolist() == [15] * 8
    assert w.q[1].tolist() == [0] * 7 + [8]
    assert w.q[2].tolist() == [1] + [0] * 6 + [15]
    assert w.zero.flatten().tolist() == [15.0] * 8
    assert torch.equal(pack_gptq(w, "gptq_v2")["qweight"], qweight)


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_round_trip(fmt, sym, group_size):
    w = random_weight(48, 256, group_size, sym=sym, seed=group_size)
    packed = pack_gptq(w, fmt)
    assert packed["qweight"].shape == (256 // 8, 48) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (256 // group_size, 48 // 8)
    assert packed["scales"].shape == (256 // group_size, 48)
    assert packed["scales"].dtype == torch.float16
    back = unpack_gptq(**packed, bits=4, group_size=group_size, sym=sym, checkpoint_format=fmt)
    assert_same(back, w)
    for key, tensor in pack_gptq(back, fmt).items():
        assert torch.equal(tensor, packed[key]), key
    if sym and fmt == "gptq":  # zero 8 is stored as 7 in every nibble
        assert (packed["qzeros"] == 0x77777777).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_desc_act_round_trip(group_size):
    g_idx = act_order_g_idx(256, group_size, seed=group_size)
    assert not has_trivial_g_idx(g_idx, group_size)
    w = random_weight(16, 256, group_size, g_idx=g_idx)
    packed = pack_gptq(w, "gptq")
    assert torch.equal(packed["g_idx"], g_idx)
    back = unpack_gptq(**packed, bits=4, group_size=group_size, sym=False, checkpoint_format="gptq")
    assert_same(back, w)
    assert torch.equal(back.dequantize(), w.dequantize())
    # the permuted groups matter: ignoring g_idx gives a different weight
    plain = Int4Weight(w.q, w.scale, w.zero, group_size)
    assert not torch.equal(plain.dequantize(), w.dequantize())


def test_trivial_g_idx_is_dropped():
    g_idx = (torch.arange(128) // 32).to(torch.int32)
    assert has_trivial_g_idx(g_idx, 32) and has_trivial_g_idx(None, 32)
    assert not has_trivial_g_idx(g_idx, 64)
    packed = pack_gptq(random_weight(8, 128, 32))
    assert torch.equal(packed["g_idx"], g_idx)
    back = unpack_gptq(**packed, bits=4, group_size=32, sym=False, checkpoint_format="gptq")
    assert back.g_idx is None


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_round_trip(group_size):
    w = random_weight(40, 256, group_size, seed=group_size + 1)
    packed = pack_awq(w)
    assert packed["qweight"].shape == (256, 40 // 8)
    assert packed["qzeros"].shape == (256 // group_size, 40 // 8)
    assert_same(unpack_awq(**packed, group_size=group_size), w)


@pytest.mark.parametrize("permuted", [False, True])
def test_dequantize_matches_formula(permuted):
    n, k, group_size = 8, 64, 32
    g_idx = act_order_g_idx(k, group_size, seed=7) if permuted else None
    w = random_weight(n, k, group_size, g_idx=g_idx, seed=5)
    expected = torch.empty(n, k)
    for row in range(n):
        for col in range(k):
            grp = int(g_idx[col]) if permuted else col // group_size
            expected[row, col] = (int(w.q[row, col]) - w.zero[row, grp]) * w.scale[row, grp]
    assert torch.equal(w.dequantize(), expected)


def test_pack_rejects_non_int4_zero_points():
    w = random_weight(8, 32, 32)
    w.zero[0, 0] = 2.5
    with pytest.raises(ValueError, match="zero points"):
        pack_gptq(w)
    w.zero[0, 0] = 16.0
    with pytest.raises(ValueError, match="zero points"):
        pack_awq(w)


# ---- checkpoint folders -------------------------------------------------------------------------

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}


def tiny_quantized_model(group_size=32, g_idx_seed=None, sym=False):
    names = ["layers.0.self_attn.q_proj", "layers.0.mlp.down_proj", "lm_head"]
    weights = {}
    for i, name in enumerate(names):
        g_idx = None if g_idx_seed is None else act_order_g_idx(64, group_size, g_idx_seed + i)
        weights[name] = random_weight(32, 64, group_size, sym=sym, g_idx=g_idx, seed=i)
    other = {
        "embed_tokens.weight": torch.randn(50, 64, dtype=torch.bfloat16),
        "norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
    }
    return weights, other


@pytest.mark.parametrize(
    "fmt,sym,desc_act", [("gptq", False, False), ("gptq_v2", True, False), ("gptq", False, True)]
)
def test_gptq_folder_round_trip(tmp_path, fmt, sym, desc_act):
    weights, other = tiny_quantized_model(g_idx_seed=1 if desc_act else None, sym=sym)
    folder = tmp_path / "ckpt"
    write_gptq_checkpoint(folder, weights, other, HF_CONFIG, sym, desc_act, fmt)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "quantize_config.json",
    ]  # fmt: skip
    assert not list(tmp_path.glob(".ckpt.tmp-*"))

    quant_config = json.loads((folder / "quantize_config.json").read_text())
    assert quant_config == {
        "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": sym, "damp_percent": 0.01,
        "true_sequential": False, "static_groups": False, "lm_head": True,
        "quant_method": "gptq", "checkpoint_format": fmt, "meta": {"quantizer": "qspec"},
    }  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == quant_config
    assert config["hidden_size"] == 64

    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "model.layers.0.self_attn.q_proj.g_idx" in names
        assert {"lm_head.qweight", "model.embed_tokens.weight", "model.norm.weight"} <= names
        assert not any(n.startswith("model.lm_head") for n in names)

    info, read_weights, read_other = read_quantized_checkpoint(folder)
    assert (info.method, info.bits, info.group_size) == ("gptq", 4, 32)
    assert (info.sym, info.desc_act, info.checkpoint_format) == (sym, desc_act, fmt)
    assert read_weights.keys() == weights.keys()
    for name, w in weights.items():
        assert_same(read_weights[name], w)
    assert read_other.keys() == other.keys()
    for name, tensor in other.items():
        assert torch.equal(read_other[name], tensor)


def test_read_quantize_config_json_and_shards(tmp_path):
    weights, other = tiny_quantized_model()
    folder = tmp_path / "ckpt"
    write_gptq_checkpoint(folder, weights, other, HF_CONFIG, sym=False)
    # Older AutoGPTQ folders: settings only in quantize_config.json (without quant_method).
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    quant_config = json.loads((folder / "quantize_config.json").read_text())
    del quant_config["quant_method"]
    (folder / "quantize_config.json").write_text(json.dumps(quant_config))
    # Re-shard into two files with an index, as large checkpoints come.
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, folder / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    info, read_weights, read_other = read_quantized_checkpoint(folder)
    assert info.source.name == "quantize_config.json" and info.checkpoint_format == "gptq"
    for name, w in weights.items():
        assert_same(read_weights[name], w)
    assert read_other.keys() == other.keys()


def write_awq_folder(folder, weights, other, quant_config=None):
    folder.mkdir()
    quant_config = quant_config or {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
    }  # fmt: skip
    (folder / "config.json").write_text(
        json.dumps({**HF_CONFIG, "quantization_config": quant_config})
    )
    tensors = {f"model.{k}": v for k, v in other.items()}
    for name, w in weights.items():
        for key, tensor in pack_awq(w).items():
            tensors[f"model.{name}.{key}"] = tensor
    save_file(tensors, folder / "model.safetensors")


def test_awq_folder_reads(tmp_path):
    weights = {
        "layers.0.self_attn.o_proj": random_weight(64, 128, 64, seed=1),
        "layers.0.mlp.gate_proj": random_weight(256, 128, 64, seed=2),
    }
    other = {"norm.weight": torch.ones(128)}
    write_awq_folder(tmp_path / "awq", weights, other)
    info, read_weights, read_other = read_quantized_checkpoint(tmp_path / "awq")
    assert (info.method, info.group_size, info.checkpoint_format) == ("awq", 64, "gemm")
    assert not info.sym and not info.desc_act
    for name, w in weights.items():
        assert_same(read_weights[name], w)
        assert torch.equal(read_weights[name].dequantize(), w.dequantize())
    assert torch.equal(read_other["norm.weight"], other["norm.weight"])


# ---- refusals -----------------------------------------------------------------------------------


def awq_folder_with(tmp_path, **changes):
    config = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True}
    config.update(changes, version=changes.get("version", "gemm"))
    folder = tmp_path / "bad"
    write_awq_folder(folder, {"layers.0.q_proj": random_weight(8, 128, 64)}, {}, config)
    return folder


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"bits": 8}, "bits=8"),
        ({"quant_method": "bitsandbytes"}, "unknown quant_method 'bitsandbytes'"),
        ({"version": "GEMV"}, "AWQ version 'GEMV'"),
        ({"group_size": -1}, "group_size -1"),
        ({"group_size": 47}, "group_size 47 is not supported"),
        ({"group_size": 48}, "scales has shape"),  # (3 groups of 128 inputs, 2 stored)
        ({"zero_point": False}, "zero_point"),
    ],
)
def test_refuses_bad_config(tmp_path, changes, message):
    with pytest.raises(QspecError, match=message):
        read_quantized_checkpoint(awq_folder_with(tmp_path, **changes))


def test_awq_version_is_case_insensitive(tmp_path):
    info, weights, _ = read_quantized_checkpoint(awq_folder_with(tmp_path, version="GEMM"))
    assert info.checkpoint_format == "gemm" and list(weights) == ["layers.0.q_proj"]


def test_refuses_unknown_gptq_format(tmp_path):
    weights, other = tiny_quantized_model()
    folder = tmp_path / "ckpt"
    write_gptq_checkpoint(folder, weights, other, HF_CONFIG, sym=False)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "marlin"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QspecError, match="checkpoint_format 'marlin'"):
        read_quantized_checkpoint(folder)


def test_refuses_missing_things(tmp_path):
    with pytest.raises(QspecError, match="does not exist"):
        read_quantized_checkpoint(tmp_path / "nowhere")

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(QspecError, match="not a quantized checkpoint"):
        read_quantized_checkpoint(plain)

    folder = awq_folder_with(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(QspecError, match="safetensors"):
        read_quantized_checkpoint(folder)

    save_file({"model.norm.weight": torch.ones(4)}, folder / "model.safetensors")
    with pytest.raises(QspecError, match="no .qweight tensors"):
        read_quantized_checkpoint(folder)

    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QspecError, match="missing"):
        read_quantized_checkpoint(folder)


@pytest.mark.parametrize(
    "key,shape,message",
    [
        ("scales", (3, 64), r"scales has shape \[3, 64\], expected \[4, 64\]"),
        ("qzeros", (4, 4), r"qzeros has shape \[4, 4\], expected \[4, 8\]"),
        ("g_idx", (100,), r"g_idx has shape \[100\], expected \[128\]"),
    ],
)
def test_refuses_shape_mismatch(tmp_path, key, shape, message):
    packed = pack_gptq(random_weight(64, 128, 32))
    packed[key] = torch.zeros(shape, dtype=packed[key].dtype)
    folder = tmp_path / "bad"
    folder.mkdir()
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False}
    (folder / "config.json").write_text(json.dumps({"quantization_config": config}))
    save_file(
        {f"model.layers.0.up_proj.{k}": v for k, v in packed.items()}, folder / "m.safetensors"
    )
    with pytest.raises(QspecError, match="layers.0.up_proj: " + message):
        read_quantized_checkpoint(folder)


def test_refuses_missing_qzeros(tmp_path):
    packed = pack_gptq(random_weight(64, 128, 32))
    del packed["qzeros"]
    folder = tmp_path / "bad"
    folder.mkdir()
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps({"quantization_config": config}))
    save_file(
        {f"model.layers.0.up_proj.{k}": v for k, v in packed.items()}, folder / "m.safetensors"
    )
    with pytest.raises(QspecError, match="up_proj has a qweight but no .qzeros"):
        read_quantized_checkpoint(folder)


def test_write_refuses_non_empty_folder(tmp_path):
    weights, other = tiny_quantized_model()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_gptq_checkpoint(folder, weights, other, HF_CONFIG, sym=False)  # empty: fine
    with pytest.raises(QspecError, match="refusing to overwrite"):
        write_gptq_checkpoint(folder, weights, other, HF_CONFIG, sym=False)


def test_write_refuses_inconsistent_settings(tmp_path):
    weights, other = tiny_quantized_model(g_idx_seed=0)
    with pytest.raises(ValueError, match="desc_act=True"):
        write_gptq_checkpoint(tmp_path / "a", weights, other, HF_CONFIG, sym=False)
    weights, other = tiny_quantized_model()
    with pytest.raises(ValueError, match="sym=True"):
        write_gptq_checkpoint(tmp_path / "b", weights, other, HF_CONFIG, sym=True)
    assert not list(tmp_path.iterdir())  # nothing half-written


# ---- a group size that does not divide in_features -----------------------------------------


def test_gptqmodel_shaped_ragged_checkpoint_imports_runs_and_exports(tmp_path):
    """What GPTQModel 7.6.0 writes for a layer of the default model (576 inputs) with its usual
    settings: group size 128, desc_act, sym, v1 format. GPTQ's groups are g_idx = i // 128
    over the channels in quantization order, so there are ceil(576 / 128) = 5 groups, the last
    one of 64 channels. Built here word by word from those rules, not with our writer:
    qweight[i, n] holds q[n, 8i + j] at bits 4j; sym zero points are 8, stored as 7 (v1), so
    every qzeros word is 0x77777777; scales fp16 [5, N]; g_idx int32 [576]."""
    K, N, G = 576, 64, 128
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    order = torch.randperm(K, generator=gen)  # desc_act: channel order[i] is quantized i-th
    g_idx = (torch.argsort(order) // G).to(torch.int32)
    assert torch.equal(torch.bincount(g_idx.long()), torch.tensor([128, 128, 128, 128, 64]))
    scales = (torch.rand(5, N, generator=gen) * 0.01 + 1e-3).half()
    qweight = torch.tensor(
        [[i32(sum(int(q[n, 8 * i + j]) << (4 * j) for j in range(8))) for n in range(N)]
         for i in range(K // 8)],
        dtype=torch.int32,
    )  # fmt: skip
    qzeros = torch.full((5, N // 8), i32(0x77777777), dtype=torch.int32)
    folder = tmp_path / "gptqmodel"
    folder.mkdir()
    quant_config = {
        "bits": 4, "group_size": G, "desc_act": True, "sym": True, "quant_method": "gptq",
        "checkpoint_format": "gptq", "damp_percent": 0.05, "static_groups": False,
    }  # fmt: skip
    (folder / "config.json").write_text(
        json.dumps({**HF_CONFIG, "hidden_size": K, "quantization_config": quant_config})
    )
    prefix = "model.layers.0.self_attn.q_proj"
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    save_file({f"{prefix}.{k}": v for k, v in tensors.items()}, folder / "model.safetensors")

    info, weights, _ = read_quantized_checkpoint(folder)
    assert (info.group_size, info.desc_act, info.sym) == (G, True, True)
    w = weights["layers.0.self_attn.q_proj"]
    dense = (q.float() - 8) * scales.float().t()[:, g_idx.long()]  # W[n, k], by the rules above
    assert torch.equal(w.dequantize(), dense)
    assert {k: torch.equal(v, tensors[k]) for k, v in pack_gptq(w).items()} == dict.fromkeys(
        tensors, True
    )  # exported back byte for byte

    from qspec_core.quant.int4 import Int4Linear

    layer = Int4Linear.from_int4_weight(w)
    assert layer.ragged and layer.perm is not None and layer.w4a8_args() is False
    torch.testing.assert_close(layer.dequantized(), dense)
    x = torch.randn(3, K, generator=gen)
    expected = x.double() @ dense.double().t()
    assert (layer(x).double() - expected).abs().max() < 0.02 * expected.abs().max()
