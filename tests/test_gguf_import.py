"""qspec's own GGUF reader (qspec_core/registry/gguf_import.py) against transformers' GGUF
import, which it replaces: the same bf16 tensors bit for bit, the same config, a tokenizer that
encodes the same. On the real default model, and on small GGUFs written here with the `gguf`
package (Llama with GQA, Qwen2 with qkv biases, each pre-tokenizer the reader covers); then the
fallback to transformers, and damaged files."""

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from qspec_core.config import ModelConfig
from qspec_core.errors import QspecError
from qspec_core.model.tokenizer import Tokenizer
from qspec_core.registry import gguf_import
from qspec_core.registry import sources as models

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing ones   ",
    "tabs\tand\nnewlines\n\n\nand runs of      spaces\r\n",
    "numbers 0 7 42 1234567 3.14159 -0.5e-10 1,000,000 2026-12-01",
    "unicode: café naïve Zürich — “quotes” 日本語のテキスト 한국어 Ελληνικά",
    "emoji 🙂👍🏽 and a ligature ﬁ, a\u00a0no-break space, a\u200bzero-width one",
    "def f(x):\n    return x**2  # square\n\tif (a && b) { return; }\n",
    "<|im_start|>user\ninline special tokens<|im_end|>\n<|endoftext|><think>",
    "'s 't 're 've 'm 'll 'd DON'T I'M",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You summarize.\n\nDoc: über 3 items"},
        {"role": "user", "content": "Summarize  it, please."},
        {"role": "assistant", "content": "It lists 3 items."},
        {"role": "user", "content": "Thanks 🙂"},
    ],
]


def transformers_convert(gguf, folder):
    """The import this reader replaces, kept in sources.py as the fallback."""
    folder.mkdir()
    models._convert_with_transformers(gguf, folder, "(the reference)", log=lambda m: None)
    return folder


def qspec_convert(gguf, folder):
    folder.mkdir()
    gguf_import.convert_gguf(gguf, folder)
    return folder


def assert_same_weights(ours, theirs):
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype == torch.bfloat16, name
        assert a[name].shape == b[name].shape, name
        assert a[name].view(torch.int16).equal(b[name].view(torch.int16)), name  # every bit


def assert_same_config(ours, theirs):
    a = json.loads((ours / "config.json").read_text())
    b = json.loads((theirs / "config.json").read_text())
    b.pop("transformers_version")
    assert a == b
    assert ModelConfig.from_hf_config(a) == ModelConfig.from_hf_config(b)
    a = json.loads((ours / "generation_config.json").read_text())
    b = json.loads((theirs / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert a.get(key) == b.get(key), key


def assert_same_tokenizer(ours, theirs):
    a, b = Tokenizer(ours), Tokenizer(theirs)
    assert (a.bos_token, a.eos_token, a.eos_token_ids) == (
        b.bos_token,
        b.eos_token,
        b.eos_token_ids,
    )
    assert a.vocab_size == b.vocab_size
    assert a.chat_template == b.chat_template
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        ids = b.encode(text)
        assert a.decode(ids) == b.decode(ids), text
    for chat in CHATS:
        for prompt in (True, False):
            assert a.render_chat(chat, prompt) == b.render_chat(chat, prompt)
            assert a.encode_chat(chat, prompt) == b.encode_chat(chat, prompt)
    for text in TEXTS:  # with the post-processor too (add_bos_token)
        assert a._tok.encode(text).ids == b._tok.encode(text).ids, text
    # the whole tokenizer.json: vocabulary, merges, added tokens, pre-tokenizer, decoder
    assert json.loads((ours / "tokenizer.json").read_text()) == json.loads(
        (theirs / "tokenizer.json").read_text()
    )


def assert_same_folder(ours, theirs):
    assert_same_weights(ours, theirs)
    assert_same_config(ours, theirs)
    assert_same_tokenizer(ours, theirs)


# The real default model (SmolLM2-135M-Instruct, Q4_1): ~3 s in this reader, ~20 s in transformers.


@pytest.fixture(scope="module")
def real_gguf(default_model_dir):
    return models._registry_gguf(models.DEFAULT_MODEL, log=lambda m: None)


@pytest.fixture(scope="module")
def real_pair(default_model_dir, real_gguf, tmp_path_factory):
    """(qspec's folder, transformers' folder) of the default model. The cached folder is one of
    them (transformers' if the cache predates this reader), so only the other is made here."""
    root = tmp_path_factory.mktemp("real-gguf")
    cached = json.loads((default_model_dir / "config.json").read_text())
    if "transformers_version" in cached:
        return qspec_convert(real_gguf, root / "qspec"), default_model_dir
    return default_model_dir, transformers_convert(real_gguf, root / "hf")


@pytest.mark.real_model
def test_real_model_weights_are_transformers_bits(real_pair):
    ours, theirs = real_pair
    assert_same_weights(ours, theirs)
    # and the file itself: same tensors, same order, same header
    assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()


@pytest.mark.real_model
def test_real_model_config_is_transformers(real_pair):
    assert_same_config(*real_pair)
    config = json.loads((real_pair[0] / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] == 3
    assert config["rope_parameters"]["rope_theta"] == 1e5


@pytest.mark.real_model
def test_real_model_tokenizer_encodes_as_transformers(real_pair):
    assert_same_tokenizer(*real_pair)


# Small GGUFs written here: what llama.cpp's converter writes, with random weights.

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = ["Ġthe", "Ġand", "ing", "Ġof", "12", "ĠĠĠ", "ĊĊ", "Ġfoo", "def", "Ġreturn", "Ã©"]
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocabulary(special=_SPECIAL):
    """Tokens, their llama.cpp types and merges of a small byte-level BPE."""
    spelled = list(gguf_import._byte_spelling().values())
    tokens, types = list(special), [3] * len(special)
    tokens += spelled
    types += [1] * len(spelled)
    merges = []
    for word in _WORDS:  # merge each word left to right
        for end in range(2, len(word) + 1):
            if word[:end] not in tokens:
                merges.append(f"{word[: end - 1]} {word[end - 1]}")
                tokens.append(word[:end])
                types.append(1)
    # a user-defined token (added whole, not special), a control token outside the byte
    # alphabet (a llama.cpp mislabel: not added), a plain token spelled with a raw space
    tokens += ["<think>", "<end of turn>", "x y"]
    types += [4, 3, 1]
    return tokens, types, merges


def write_gguf(
    path,
    arch="llama",
    pre="smollm",
    tied=True,
    add_bos=False,
    name="Tiny",
    special=_SPECIAL,
    rope_freqs=None,
):
    """A 2-layer model (hidden 64, 4 heads, 2 KV heads) in the types llama.cpp writes:
    Q8_0, Q4_1, Q5_0, F16 and F32 tensors; `rope_freqs`: Llama 3's RoPE divisors [8]."""
    rng = np.random.default_rng(0)
    tokens, types, merges = _vocabulary(special)
    hidden, ffn, heads, kv_heads, n_layers = 64, 96, 4, 2, 2
    head_dim = hidden // heads
    writer = GGUFWriter(path, arch)
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(n_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    if pre is not None:  # (files from before the key)
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(_TEMPLATE)

    def add(tensor_name, shape, qtype):
        values = rng.standard_normal(shape, dtype=np.float32) * 0.05
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, values + 1.0)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(tensor_name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor_name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), hidden), GGMLQuantizationType.F16)
    if not tied:
        add("output.weight", (len(tokens), hidden), GGMLQuantizationType.Q8_0)
    add("output_norm.weight", (hidden,), GGMLQuantizationType.F32)
    if rope_freqs is not None:  # (where llama.cpp's converter puts it)
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), GGMLQuantizationType.F32)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), GGMLQuantizationType.Q4_1)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), GGMLQuantizationType.Q5_0)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (heads * head_dim,), GGMLQuantizationType.F32)
            add(f"blk.{i}.attn_k.bias", (kv_heads * head_dim,), GGMLQuantizationType.F32)
            add(f"blk.{i}.attn_v.bias", (kv_heads * head_dim,), GGMLQuantizationType.F32)
        add(f"blk.{i}.attn_output.weight", (hidden, hidden), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), GGMLQuantizationType.F32)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), GGMLQuantizationType.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), GGMLQuantizationType.Q8_0)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "arch,pre,tied,add_bos,name,special",
    [
        ("llama", "smollm", True, False, "Tiny", _SPECIAL),  # the default model's shape
        # Llama 3's split, a BOS, no general.name, no <|endoftext|> (GPT-2's default special
        # token, which transformers adds all the same: a token past the embedding rows)
        ("llama", "llama-bpe", False, True, None, ["<s>", "</s>", "<pad>"]),
        ("llama", None, True, False, "Tiny", _SPECIAL),  # no pre-tokenizer named
        ("qwen2", "qwen2", False, False, "Tiny", _SPECIAL),  # Qwen2.5: qkv biases, own head
        ("qwen2", "deepseek-r1-qwen", True, False, "Tiny", _SPECIAL),
    ],
)
def test_small_gguf_converts_as_transformers(tmp_path, arch, pre, tied, add_bos, name, special):
    gguf = write_gguf(tmp_path / "tiny.gguf", arch, pre, tied, add_bos, name, special)
    ours = qspec_convert(gguf, tmp_path / "qspec")
    assert_same_folder(ours, transformers_convert(gguf, tmp_path / "hf"))
    tokenizer = Tokenizer(ours)
    assert tokenizer.encode("<think>") == [len(_vocabulary()[0]) - 3]  # whole
    assert len(tokenizer.encode("<end of turn>")) > 1  # not added: cut into pieces


def test_unpermuting_llama_q_k_restores_the_rotary_halves():
    """llama.cpp stores each head's rows as pairs (i, i + D/2) side by side; HF as halves."""
    heads, head_dim = 3, 8
    hf = torch.arange(heads * head_dim, dtype=torch.float32)[:, None].repeat(1, 2)  # row ids
    per_head = hf.reshape(heads, 2, head_dim // 2, 2)  # llama.cpp's permute, as it writes it
    stored = per_head.transpose(1, 2).reshape(hf.shape)
    assert stored[:4, 0].tolist() == [0, 4, 1, 5]
    assert gguf_import._unpermute_rope_rows(stored, heads).equal(hf)


# Llama 3.x: llama.cpp's converter writes the scaled RoPE as divisors, `rope_freqs.weight`


def llama3_divisors(params, theta=10000.0, head_dim=16):
    """The divisors of the unscaled frequencies that qspec's rope.py gives HF's llama3 params."""
    from qspec_core.model.rope import _llama3

    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return (inv_freq / _llama3(inv_freq, params)).numpy()


LLAMA_3_1 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA_3_2 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("params", [LLAMA_3_1, LLAMA_3_2], ids=["3.1", "3.2"])
@pytest.mark.parametrize("old_len", [8192, 4096])
def test_llama3_rope_freqs_become_its_rope_parameters(tmp_path, params, old_len):
    params = {"rope_type": "llama3", **params, "original_max_position_embeddings": old_len}
    divisors = llama3_divisors(params)
    assert (divisors == 1).any() and divisors.max() > 1  # (some kept, some scaled)
    scaled = qspec_convert(write_gguf(tmp_path / "l3.gguf", rope_freqs=divisors), tmp_path / "q")
    config = json.loads((scaled / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": 10000.0, **params}
    ours = ModelConfig.from_file(scaled / "config.json")
    from qspec_core.model.rope import inv_frequencies

    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    torch.testing.assert_close(inv_frequencies(ours)[0], plain / torch.from_numpy(divisors))
    plain_folder = qspec_convert(write_gguf(tmp_path / "plain.gguf"), tmp_path / "p")
    assert_same_weights(scaled, plain_folder)  # the divisors are no weight


def test_rope_freqs_all_ones_is_no_scaling(tmp_path):
    folder = qspec_convert(write_gguf(tmp_path / "a.gguf", rope_freqs=[1.0] * 8), tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}


@pytest.mark.parametrize(
    "divisors",
    [[1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.5, 3.0], [1.0] * 7 + [0.5], [1.0] * 6 + [2.5, 9.0]],
    ids=["not-monotone", "below-one", "two-bands"],
)
def test_rope_freqs_that_are_not_llama3_are_not_covered(tmp_path, divisors):
    with pytest.raises(gguf_import.NotCovered, match="rope_freqs"):
        gguf_import.convert_gguf(write_gguf(tmp_path / "x.gguf", rope_freqs=divisors), tmp_path)


# Files the reader does not cover go to transformers; without it, one line says what to do.


def test_uncovered_gguf_falls_back_to_transformers(tmp_path, monkeypatch):
    gguf = write_gguf(tmp_path / "odd.gguf", pre="some-new-pre")
    with pytest.raises(gguf_import.NotCovered, match="pre-tokenizer 'some-new-pre'"):
        gguf_import.convert_gguf(gguf, tmp_path)
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    messages = []
    folder = models.ensure_gguf_converted(gguf, log=messages.append)
    assert any("converting it with transformers" in m for m in messages)
    assert (folder / "qspec_source.json").exists()
    covered = qspec_convert(write_gguf(tmp_path / "covered.gguf"), tmp_path / "covered")
    assert_same_weights(folder, covered)  # the same file but for its pre-tokenizer's name


def test_uncovered_gguf_without_transformers_says_pip_install(tmp_path, monkeypatch):
    gguf = write_gguf(tmp_path / "odd.gguf", pre="some-new-pre")
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name: None if name == "transformers" else real_find_spec(name),
    )
    with pytest.raises(QspecError) as error:
        models.resolve_model(str(gguf))
    message = str(error.value)
    assert "\n" not in message and "pre-tokenizer 'some-new-pre'" in message
    assert "pip install 'transformers>=5,<5.25' accelerate" in message
    assert not list((tmp_path / "home" / "models").iterdir())  # no half folder


def test_uncovered_gguf_with_hub_kernels_installed_says_what_clashes(tmp_path, monkeypatch):
    """transformers >= 5.25 brings Hugging Face's `kernels`, whose import name is qspec's own
    package: its model code would fail to import, so qspec says so in one line first."""
    gguf = write_gguf(tmp_path / "odd.gguf", pre="some-new-pre")
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "hub_kernels_installed", lambda: True)
    with pytest.raises(QspecError) as error:
        models.resolve_model(str(gguf))
    message = str(error.value)
    assert "\n" not in message and "Hugging Face's `kernels`" in message
    assert "pip uninstall -y kernels && pip install 'transformers>=5,<5.25'" in message
    assert not list((tmp_path / "home" / "models").iterdir())


def test_hub_kernels_are_not_installed_beside_the_test_extra():
    """The test extra pins transformers below 5.25, so Hugging Face's `kernels` is not pulled
    in (a CI install of 5.25 failed 198 of its first 897 tests on the name clash)."""
    assert not models.hub_kernels_installed()


# Damaged files: one QspecError line, nothing left in the cache.


def _damaged(tmp_path, damage):
    gguf = write_gguf(tmp_path / "model.gguf")
    data = bytearray(gguf.read_bytes())
    gguf.write_bytes(damage(data))
    return gguf


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda d: b"GGML" + d[4:], r"not a GGUF file \(it starts with b'GGML'"),
        (lambda d: d[:4] + (1).to_bytes(4, "little") + d[8:], "GGUF version 1"),
        (lambda d: d[:-100], r"truncated: tensor blk\.1\.ffn_down\.weight ends at byte"),
        (lambda d: d[:3000], "truncated"),
        (lambda d: d[:23], "23 bytes, too short"),
        (lambda d: b"", "0 bytes, too short"),
    ],
    ids=["magic", "version", "tensor-data", "header", "23-bytes", "empty"],
)
def test_damaged_gguf_is_one_user_error(tmp_path, monkeypatch, damage, reason):
    gguf = _damaged(tmp_path, damage)
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    with pytest.raises(QspecError, match=f"cannot read GGUF {gguf}: ({reason})") as error:
        models.resolve_model(str(gguf))
    assert "\n" not in str(error.value)
    assert not list((tmp_path / "home" / "models").iterdir())


def test_cut_at_every_header_field_is_a_user_error(tmp_path):
    """Cut the header at many points: every one is a QspecError, never another exception."""
    gguf = write_gguf(tmp_path / "model.gguf")
    data = gguf.read_bytes()
    header_end = data.index(b"blk.1.ffn_down.weight") + 60  # past the tensor table
    cut = tmp_path / "cut.gguf"
    for size in sorted({*range(0, 200, 7), *range(200, header_end, 997), header_end}):
        cut.write_bytes(data[:size])
        with pytest.raises(QspecError, match="cannot read GGUF"):
            gguf_import.convert_gguf(cut, tmp_path)
        assert not [p for p in tmp_path.iterdir() if p.suffix != ".gguf"]


def test_token_id_outside_the_vocabulary_is_a_user_error(tmp_path):
    gguf = write_gguf(tmp_path / "model.gguf")
    data = gguf.read_bytes()
    key = b"tokenizer.ggml.eos_token_id"
    at = data.index(key) + len(key) + 4  # past the value type
    gguf.write_bytes(data[:at] + (10**6).to_bytes(4, "little") + data[at + 4 :])
    (tmp_path / "out").mkdir()
    with pytest.raises(QspecError, match="eos_token_id 1000000 is not in the vocabulary"):
        gguf_import.convert_gguf(gguf, tmp_path / "out")


def test_random_header_bytes_give_a_user_error_or_the_fallback(tmp_path):
    """300 GGUFs with 1-4 random header bytes changed (fixed seed): each converts, is refused
    as damaged (QspecError) or goes to transformers (NotCovered); nothing else escapes."""
    gguf = write_gguf(tmp_path / "model.gguf")
    data = gguf.read_bytes()
    header_end = data.index(b"blk.1.ffn_down.weight") + 60
    rng = np.random.default_rng(1)
    bad, out = tmp_path / "bad.gguf", tmp_path / "out"
    outcomes = set()
    for _ in range(300):
        damaged = bytearray(data)
        for at in rng.integers(0, header_end, size=rng.integers(1, 5)):
            damaged[at] = rng.integers(0, 256)
        bad.write_bytes(bytes(damaged))
        out.mkdir()
        try:
            gguf_import.convert_gguf(bad, out)
            outcomes.add("converted")
        except (QspecError, gguf_import.NotCovered) as e:
            outcomes.add(type(e).__name__)
        shutil.rmtree(out)
    assert outcomes == {"converted", "QspecError", "NotCovered"}


# An architecture qspec does not run, or a file without a tokenizer, is refused before any
# conversion, in one line, with no advice to install transformers (it would not help).


def _odd_gguf(path, arch="mamba", tokenizer=True):
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "arch,tokenizer,words",
    [
        ("mamba", True, "architecture 'mamba', which qspec does not run (it runs"),
        ("llama", False, "no tokenizer (tokenizer.ggml.model)"),
    ],
    ids=["architecture", "no-tokenizer"],
)
def test_a_gguf_qspec_cannot_run_is_one_line_without_pip(tmp_path, capsys, arch, tokenizer, words):
    from test_cli_input import assert_one_error, qspec

    gguf = _odd_gguf(tmp_path / "odd.gguf", arch, tokenizer)
    messages = []
    with pytest.raises(QspecError) as refused:
        models.ensure_gguf_converted(gguf, log=messages.append)
    assert words in str(refused.value) and "pip install" not in str(refused.value)
    assert messages == []  # ("converting ... (once)" only for a file that will convert)
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted 41 ships.\n")
    # (the user's QSPEC_HOME: a fresh one would build the CPU kernels first; nothing is written)
    assert_one_error(qspec(capsys, "summarize", doc, "--model", gguf), words)


@pytest.mark.parametrize("cut", [100, 3000], ids=["tensor-data", "header"])
def test_a_damaged_gguf_is_refused_before_the_converting_line(tmp_path, capsys, cut):
    """The error alone: no "converting ... (once)" line before it (three lines, once)."""
    from test_cli_input import assert_one_error, qspec

    gguf = _damaged(tmp_path, lambda d: d[:-cut] if cut == 100 else d[:cut])
    messages = []
    with pytest.raises(QspecError, match="truncated"):
        models.ensure_gguf_converted(gguf, log=messages.append)
    assert messages == []
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted 41 ships.\n")
    assert_one_error(qspec(capsys, "summarize", doc, "--model", gguf), "truncated")
