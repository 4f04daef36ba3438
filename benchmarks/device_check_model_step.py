"""The model_step section of device_check: a timing projection of a 7B-shaped draft step,
verify step and autoregressive step (per layer the seven GEMMs plus attention, no
norms/rope), and the speculative speedup they project."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from device_check_harness import Report, Settings, cuda_cleanup, event_ms, gbps, graph_ms
from device_check_inputs import KV_VIEW, history_bytes, int4_weight, random_cache


def _layer_linears(s: Settings, n_kv: int) -> list[tuple[int, int]]:
    """(K, N) of q, k, v, o, gate, up, down in one Llama layer."""
    h, kv = s.hidden, n_kv * s.head_dim
    i = s.intermediate
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


def _build_step(s: Settings, n_kv: int, length: int, kind: str, T: int):
    """A function running one step's kernels for all layers, and the bytes it must read.

    kind "ar": bf16 GEMMs + SDPA over a bf16 cache; "draft": W4A16 GEMMs + draft-view
    attention; "verify": bf16 GEMMs + target-view attention. Activations are fixed inputs
    (timing only); `distinct_layers` weight and cache sets are cycled over the layers.
    """
    from kernels.triton.hier_attention import hier_attention_launcher
    from kernels.triton.w4a16 import w4a16_matmul

    dev, dtype = s.device, getattr(torch, s.dtype)
    shapes = _layer_linears(s, n_kv) + [(s.hidden, s.vocab)]  # lm_head last, once per step
    inputs = {k: torch.randn(T, k, device=dev).to(dtype) for k in {k for k, _ in shapes}}
    sets, nbytes = [], 0.0
    for layer in range(min(s.distinct_layers, s.layers)):
        if kind == "draft":
            weights = [int4_weight(n, k, s, dev) for k, n in shapes]
            gemms = [
                (lambda x=inputs[k], w=w: w4a16_matmul(x, *w, s.weight_group))
                for (k, _), w in zip(shapes, weights, strict=True)
            ]
            per_weight = [n * k / 2 + 4 * n * k // s.weight_group for k, n in shapes]
        else:
            weights = [torch.randn(n, k, device=dev).to(dtype) for k, n in shapes]
            gemms = [
                (lambda x=inputs[k], w=w: F.linear(x, w))
                for (k, _), w in zip(shapes, weights, strict=True)
            ]
            per_weight = [2 * n * k for k, n in shapes]
        if kind == "ar":
            q = torch.randn(1, s.heads, 1, s.head_dim, device=dev).to(dtype)
            cache = torch.randn(2, 1, n_kv, length + 1, s.head_dim, device=dev).to(dtype)

            def attend(q=q, c=cache):
                return F.scaled_dot_product_attention(q, c[0], c[1], enable_gqa=n_kv != s.heads)

            kv_bytes = cache.numel() * cache.element_size()
        else:
            view = "draft" if kind == "draft" else "target"
            q, hier, queries = random_cache(s, n_kv, length, T, exact=False, seed=layer)
            attend = hier_attention_launcher(q, hier, queries, KV_VIEW[view])
            kv_bytes = history_bytes(s, n_kv, length, T, view)
        sets.append((gemms[:-1], attend, gemms[-1]))
        if layer == 0:
            nbytes = s.layers * (sum(per_weight[:-1]) + kv_bytes) + per_weight[-1]

    def step():
        for layer in range(s.layers):
            gemms, attend, _ = sets[layer % len(sets)]
            for gemm in gemms[:3]:  # q, k, v
                gemm()
            attend()
            for gemm in gemms[3:]:  # o, gate, up, down
                gemm()
        sets[0][2]()  # lm_head

    return step, nbytes


def tokens_per_round(acceptance: float, gamma: int) -> float:
    """Expected tokens per speculative round at a per-token acceptance rate a: (1 - a^(g+1))
    / (1 - a) (accepted drafts plus the recovered or bonus token)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def section_model_step(s: Settings, report: Report, acceptance: float, gamma: int) -> None:
    """Timing projection of a 7B-shaped model: per layer the seven GEMMs plus attention
    (no norms, rope, sampling). CUDA-graph replay where possible (GPU time), eager too."""
    block = report.data.setdefault("model_step", {})
    block.update(
        label="timing projection: per layer 7 GEMMs + attention, random weights, no norms/rope",
        acceptance=acceptance,
        gamma=gamma,
        tokens_per_round=tokens_per_round(acceptance, gamma),
        layers=s.layers,
        hidden=s.hidden,
        intermediate=s.intermediate,
    )
    rows = block.setdefault("rows", [])
    speedups = block.setdefault("projected_speedup", {})
    for length in s.model_lengths:
        for n_kv in s.model_kv_heads:
            with report.item(f"model_step L={length} n_kv={n_kv}", 20) as go:
                if not go:
                    continue
                row = {"length": length, "n_kv": n_kv, "ms": {}, "eager_ms": {}, "gbps": {}}
                row["method"] = {}  # per step: "cuda_graph" (GPU time) or "eager"
                rows.append(row)
                for kind, T in (("ar", 1), ("draft", 1), ("verify", gamma + 1)):
                    step, nbytes = _build_step(s, n_kv, length, kind, T)
                    row["eager_ms"][kind] = _eager_ms(step, s)
                    row["ms"][kind] = row["eager_ms"][kind]
                    row["method"][kind] = "eager"
                    if s.device == "cuda":
                        try:
                            row["ms"][kind] = graph_ms(step)
                            row["method"][kind] = "cuda_graph"
                        except Exception as exc:  # keep the eager number
                            row.setdefault("graph_errors", {})[kind] = repr(exc)[:300]
                            cuda_cleanup()
                    row["gbps"][kind] = gbps(nbytes, row["ms"][kind])
                    del step
                    cuda_cleanup()
                ms = row["ms"]
                round_cost = (gamma * ms["draft"] + ms["verify"]) / ms["ar"]
                row["projected_speedup"] = block["tokens_per_round"] / round_cost
                speedups[f"L={length},n_kv={n_kv}"] = row["projected_speedup"]


def _eager_ms(step, s: Settings) -> float:
    if s.device == "cuda":
        return event_ms(step, reps=3)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3
