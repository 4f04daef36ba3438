"""Llama 2/3.x (and SmolLM2, which is a Llama): the default `LayerSpec`."""

from qspec_core.families.spec import Family

FAMILY = Family(model_types=("llama",), label="Llama 2/3.x, SmolLM2")
