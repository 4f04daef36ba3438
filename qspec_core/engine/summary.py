"""The record of one summary (`qspec summarize --json`): the text, what it reproduces, and
the numbers of the reply that wrote it."""

from __future__ import annotations

import torch

from qspec_core.runner.kernel_table import prefill_attention
from qspec_core.timing import peak_rss_bytes

# What output of each --target-weights follows: the distribution a run's text is drawn from.
TARGET_DISTRIBUTION = {
    "full": "the target path: full-precision weights, INT8 KV (ar: full-precision KV)",
    "int8": "the INT8-weight target path: per-channel INT8 weights, INT8 KV (ar: full KV)",
    "w8a8": "the W8A8 target path: per-channel INT8 weights, activations rounded to int8 per "
    "64 inputs, INT8 KV with queries rounded to int16 (ar: full KV)",
}


def reproduces(mode: str, target_weights: str) -> str:
    """The model whose output a run in `mode` follows (ar runs on full-precision KV)."""
    if mode != "ar":
        return TARGET_DISTRIBUTION[target_weights]
    with_weights = {"int8": " with INT8 weights", "w8a8": " with INT8 weights and activations"}
    return "the full-precision model" + with_weights.get(target_weights, "")


def prefill_products(mode: str, device) -> str | None:
    """The products of the prefill attention a run in `mode` computes on `device` (None off
    the CPU): the runner's choice for its cache (`kernel_table.prefill_attention`: the measured
    ones for the hierarchical cache, the fp32 numbers on the faster path for ar's)."""
    if torch.device(device).type != "cpu":
        return None
    return prefill_attention("full" if mode == "ar" else "hierarchical", device)


def summary_record(session, model_name: str, target_weights: str) -> dict:
    """One JSON-ready object for the last reply of `session` (a `ChatSession`)."""
    stats = session.last
    record = {
        "text": session.last_text,
        "mode": session.mode,
        "target_weights": target_weights,
        "reproduces": reproduces(session.mode, target_weights),
        "prefill_products": prefill_products(session.mode, session.runtime.model.device),
        "model": model_name,
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 3),
        "truncated_tokens": session.truncated_tokens,
        "timings_s": {k: round(v, 6) for k, v in stats.timings_s.items()},
        "peak_rss_bytes": peak_rss_bytes(),  # (the process's, model and caches included)
    }
    if stats.spec is not None:
        record["stats"] = stats.spec.to_dict(session.gamma)
    return record
