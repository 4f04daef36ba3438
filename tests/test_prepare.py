"""Loading never converts: a named model's converted folder is made by an explicit step
(`registry.prepare`), and loading without it is an error that says what to do."""

import json

import pytest

import qspec_core.convert.convert as convert_module
from qspec_core.errors import QspecError
from qspec_core.registry import prepare
from qspec_core.registry.runtime import load_runtime
from qspec_core.registry.sources import DEFAULT_MODEL


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))

    def no_conversion(*args, **kwargs):
        raise AssertionError("loading must not convert")

    monkeypatch.setattr(convert_module, "convert", no_conversion)
    monkeypatch.setattr(prepare, "convert", no_conversion)
    monkeypatch.setattr(prepare, "ensure_registry_model", no_conversion)
    return tmp_path


def test_loading_a_named_model_without_its_converted_folder_says_so(empty_home):
    assert prepare.conversion_needed(DEFAULT_MODEL) == "no 4-bit draft yet"
    for kwargs in ({"need_draft": True}, {"target_weights": "int8"}):
        with pytest.raises(QspecError, match="not converted yet .*prepare_named"):
            load_runtime(None, dtype="fp32", log=lambda m: None, **kwargs)
    assert not any(empty_home.rglob("*.safetensors"))  # nothing made, nothing half-written


def test_prepare_for_only_names_models_that_need_a_converted_folder(empty_home, tmp_path):
    # (each would call prepare_named, which here would fail loudly)
    assert prepare.prepare_for(str(tmp_path), need_draft=True) is None  # a folder: as it is
    assert prepare.prepare_for(None, need_draft=False) is None  # no draft needed
    with pytest.raises(AssertionError, match="must not convert"):
        prepare.prepare_for(None, need_draft=True, log=lambda m: None)


def test_an_older_int8_scheme_needs_the_upgrade(empty_home):
    folder = prepare.converted_folder(DEFAULT_MODEL)
    folder.mkdir(parents=True)
    meta = folder / "qspec_draft.json"
    recipe = {"name": DEFAULT_MODEL.draft_recipe}
    meta.write_text(json.dumps({"recipe": recipe, "target_int8": {"method": "rtn"}}))
    assert "INT8 verifier weights are from an older" in prepare.conversion_needed(DEFAULT_MODEL)
    int8 = {"method": convert_module.INT8_METHOD}
    meta.write_text(json.dumps({"recipe": recipe, "target_int8": int8}))
    assert prepare.conversion_needed(DEFAULT_MODEL) is None


def test_a_draft_of_another_recipe_is_made_again(empty_home):
    """The default model's draft recipe changed (issue 19's sweep): a folder made before
    recipes existed, or with another one, is converted again, not just upgraded."""
    folder = prepare.converted_folder(DEFAULT_MODEL)
    folder.mkdir(parents=True)
    meta = folder / "qspec_draft.json"
    int8 = {"method": convert_module.INT8_METHOD}
    assert DEFAULT_MODEL.draft_recipe != "gptq"
    for recipe in (None, {"name": "gptq"}):
        meta.write_text(json.dumps({"recipe": recipe, "target_int8": int8}))
        why = prepare.conversion_needed(DEFAULT_MODEL)
        assert (
            why
            == f"its 4-bit draft is from an older recipe (gptq; now {DEFAULT_MODEL.draft_recipe})"
        )
        with pytest.raises(AssertionError, match="must not convert"):  # the whole conversion
            prepare.prepare_named(DEFAULT_MODEL, log=lambda m: None)
