"""How close the two KV views are to full precision, on a real model and text.

Teacher-forced: the text is fed through each path in G-aligned chunks of G tokens (so every
token sees the history quantized exactly as in token-by-token decoding) and the logits of
every position are compared with those of the full-precision cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.cache.sizes import full_kv_bytes
from qspec_core.model.transformer import Transformer, forward_logits, has_int8
from qspec_core.precision import DRAFT_KV4, FP, TARGET, W8, W8_TARGET


@dataclass
class KVQuality:
    tokens: int
    group_size: int
    perplexity: dict[str, float]  # per path: fp, target, draft (+ w8, w8-target: INT8 weights;
    # w8a8, w8a8-target: the same with int8 activations)
    kl_vs_fp: dict[str, float]  # mean KL(p_fp || p_path) per position, nats
    top1_vs_fp: dict[str, float]  # share of positions whose argmax equals the fp argmax
    top1_draft_vs_target: float
    bytes_per_token: dict[str, float]  # over all layers and KV heads

    def to_dict(self) -> dict:
        return asdict(self)


def measure_kv_quality(
    model: Transformer, ids: list[int], group_size: int | None = None, on_path=None, runner=None
) -> KVQuality:
    """Perplexity, KL and top-1 agreement of the target (INT8) and draft (INT4) KV views.
    `runner` runs the forwards (the runtime's; default: the model itself, its reference)."""
    runner = runner or model
    config = model.config
    G = group_size or config.head_dim
    targets = torch.tensor(ids[1:], device=model.device)
    logits = {}
    # name -> path: w8 and w8-target are Quasar's INT8-weight verifier, with full and INT8
    # KV, measured when the model carries INT8 weights (a converted folder); "draft" is the
    # INT4 view alone (full weights, even when the model has a 4-bit draft)
    runs = {"fp": FP, "target": TARGET, "draft": DRAFT_KV4}
    if has_int8(model):
        runs |= {"w8": W8, "w8-target": W8_TARGET}
    if "w8a8" in model.weight_sets:
        runs |= {"w8a8": W8.with_weights("w8a8"), "w8a8-target": W8_TARGET.with_weights("w8a8")}
    for name, path in runs.items():
        if on_path:
            on_path(name)
        if path.kv == "fp":
            cache = FullPrecisionCache(config, len(ids), dtype=model.dtype, device=model.device)
        else:
            cache = HierarchicalKVCache(config, len(ids), G, dtype=model.dtype, device=model.device)
        logits[name] = forward_logits(runner, cache, ids, path, G)[:-1]  # predict ids[1:]
    logp = {p: torch.log_softmax(x, -1) for p, x in logits.items()}
    ppl = {p: math.exp(float(-lp.gather(-1, targets[:, None]).mean())) for p, lp in logp.items()}
    p_fp = logp["fp"].exp()
    others = [p for p in logits if p != "fp"]
    kl = {p: float((p_fp * (logp["fp"] - logp[p])).sum(-1).mean()) for p in others}
    argmax = {p: x.argmax(-1) for p, x in logits.items()}
    top1 = {p: float((argmax[p] == argmax["fp"]).float().mean()) for p in others}
    probe = HierarchicalKVCache(config, G, G, dtype=model.dtype, device=model.device)
    return KVQuality(
        tokens=len(ids),
        group_size=G,
        perplexity=ppl,
        kl_vs_fp=kl,
        top1_vs_fp=top1,
        top1_draft_vs_target=float((argmax["draft"] == argmax["target"]).float().mean()),
        bytes_per_token={
            "bf16": float(full_kv_bytes(config, 1, 2)),
            "fp32": float(full_kv_bytes(config, 1, 4)),
            "target": probe.bytes_per_token(TARGET.kv),
            "draft": probe.bytes_per_token(DRAFT_KV4.kv),
        },
    )
