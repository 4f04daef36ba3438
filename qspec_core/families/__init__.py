"""Model families, one file each: what a family's decoder layer is made of (`LayerSpec`) and
how its Hugging Face `config.json` keys map onto `ModelConfig` (`Family`).

A family file defines `FAMILY = Family(...)`; every module of this package that does is
registered by its `model_types`, so adding a family is one file (and its parity test in
`tests/test_families.py`). `config.py` reads the table; the model builds its layers from
`ModelConfig.layer`; the CPU runner runs a step in one C++ call where
`LayerSpec.native_ok()` says the stack computes the layer (every family now).
"""

from __future__ import annotations

import importlib
import pkgutil

from qspec_core.families.spec import Family, LayerSpec

__all__ = ["FAMILIES", "Family", "LayerSpec", "family_for", "supported_model_types"]


def _discover() -> dict[str, Family]:
    table: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            for model_type in family.model_types:
                if model_type in table:
                    raise RuntimeError(f"two families claim model_type {model_type!r}")
                table[model_type] = family
    return table


FAMILIES: dict[str, Family] = _discover()  # HF model_type -> its family


def family_for(model_type) -> Family | None:
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def supported_model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def supported_names() -> str:
    """ "Llama 2/3.x, Mistral, ..." in table order, each family once."""
    labels = dict.fromkeys(family.label for family in FAMILIES.values())
    return ", ".join(labels)
