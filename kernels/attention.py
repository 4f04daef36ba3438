"""Attention over one layer of the hierarchical INT4/INT8 KV cache: the one entry point.

    hier_attention(q, view, rows, kv, chunk_size=None, fused=True, int_queries=False)
        -> [B, H, T, D]

q [B, H, T, D]; `view` the layer as stored (`kernels.planes.HierLayerView`); `rows` which keys
each query sees (`kernels.planes.QueryRows`); `kv` the KV view, "int8" (both planes) or "int4"
(the upper plane). Three implementations take exactly these arguments:

- the C++ kernel (`kernels/cpu/attention.py`), for CPU tensors when it is built here;
- the Triton kernel (`kernels/triton/hier_attention.py`) where Triton runs: CUDA, or the CPU
  under TRITON_INTERPRET=1 (a test tool, so the compiled C++ kernel comes first on the CPU);
- the PyTorch reference (`kernels.reference.hier_attention_ref`) everywhere else, and always
  with fused=False.

`int_queries` rounds the queries to int16 per head and K group and scores the history with
integer dot products (the CPU's W8A8 target and W4A8 draft: `kernels/cpu/attention_int.h`);
the C++ kernel and the reference do it, the Triton kernel does not, so such a call never goes
to Triton.

The two kernels are batch-invariant in the query rows: a query's output does not depend, to
the bit, on which other queries share the call, which greedy speculative decoding's equality
with autoregressive decoding rests on. The reference is the check of their numbers (one fp32
softmax over every key any query sees) and makes no such promise.
"""

from __future__ import annotations

import torch

from kernels.cpu import attention as cpu_attention
from kernels.planes import HierLayerView, QueryRows
from kernels.reference import causal_attention as causal_attention_ref
from kernels.reference import cuts, hier_attention_ref
from kernels.triton import hier_attention as triton_attention

BACKENDS = ("cpu", "triton", "reference")


def backend(q: torch.Tensor, fused: bool = True, int_queries: bool = False) -> str:
    """Which implementation `hier_attention` runs for q: one of BACKENDS."""
    if not fused:
        return "reference"
    if q.device.type == "cpu" and cpu_attention.available():
        return "cpu"
    if triton_attention.triton_usable(q) and not int_queries:
        return "triton"
    return "reference"


def hier_attention(
    q: torch.Tensor,
    view: HierLayerView,
    rows: QueryRows,
    kv: str,
    chunk_size: int | None = None,
    fused: bool = True,
    int_queries: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q over one cache layer in the KV view `kv` -> [B, H, T, D] in q's dtype.

    `chunk_size`: history tokens per program or thread task (None: each kernel's default; the
    Triton one sizes chunks to fill the GPU). The result depends on it in the last bits (the
    chunks merge by log-sum-exp), never on T. fused=False: the reference, whatever runs here.
    `softcap`: Gemma 2's attn_logit_softcapping on the scaled scores (None: none).
    """
    chosen = backend(q, fused, int_queries)
    if chosen == "triton" and rows.parents is not None:
        chosen = "reference"  # (the Triton kernel reads chains only: a tree verify's rows)
    if chosen == "cpu":
        return cpu_attention.hier_attention_cpu(q, view, rows, kv, chunk_size, int_queries, softcap)
    if chosen == "triton":
        return triton_attention.hier_attention_triton(
            q, view, rows, kv, chunk_size, softcap=softcap
        )
    return hier_attention_ref(q, view, rows, kv, chunk_size, int_queries, softcap)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    products: str | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`kernels.reference.causal_attention` (queries at `input_pos` over keys 0..S-1), with a
    prefill's chunk on a CPU through the tiled C++ kernel (`cpu_attention.prefill_attention`:
    no [T, S] scores in memory, 2-3x SDPA's speed there, docs/PERF.md), its products
    `products` (`cpu_attention.prefill_products`; None: QSPEC_PREFILL_PRODUCTS, else fp32).
    A local layer's sliding `window` and Gemma 2's `softcap` are the tiled kernel's too (its
    chunk reads the blocks its window reaches). Decode and verify steps (at most
    `kernels.MAX_STEP_ROWS` rows) and other devices take the reference, with `mask` where
    given (the reference's [T, S] mask of those rows)."""
    T = q.shape[2]
    if cpu_attention.prefill_usable(q, k, v):
        start = int(input_pos[0])
        if start + T <= k.shape[2] and torch.equal(
            input_pos, torch.arange(start, start + T, device=input_pos.device)
        ):
            w = window if cuts(window, start + T) else None
            return cpu_attention.prefill_attention(q, k, v, start, products, w, softcap)
    return causal_attention_ref(q, k, v, input_pos, mask, softcap, window)
