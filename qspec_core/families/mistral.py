"""Mistral: Llama's layer, with a sliding window on every layer."""

from qspec_core.families.spec import Family

FAMILY = Family(model_types=("mistral",), label="Mistral", sliding_window="all")
