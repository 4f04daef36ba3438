"""One layer's decode attention on CPU, side by side: the fused hierarchical kernel (INT4 and
INT8 KV views, with fp32 queries and with the int16 queries of the W4A8 draft and the W8A8
target: "int-q") against SDPA over a full-precision cache (fp32 and bf16) and the PyTorch
reference `kernels.reference.hier_attention_ref` (dequantize, then attend).

    python benchmarks/cpu_attention.py --context 2048,8192 [--heads 9 --kv-heads 3 --dim 64]

Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, G 64). Medians of
interleaved repeats; the ratio column is SDPA-over-bf16 time / this variant's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kernels.cpu import attention as cpu_attention
from kernels.planes import (
    HierLayerView,
    QueryRows,
    kv_bytes_per_token,
    quantize_keys,
    quantize_values,
)
from kernels.reference import hier_attention_ref


def _time(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def bench(context: int, H: int, n_kv: int, D: int, G: int, T: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    nq = (context // G - 1) * G  # what the cache holds quantized at this length
    k = torch.randn(1, n_kv, context, D, generator=g)
    v = torch.randn(1, n_kv, context, D, generator=g)
    kq, vq = quantize_keys(k[:, :, :nq], G), quantize_values(v[:, :, :nq], G)
    q = torch.randn(1, H, T, D, generator=g)
    pos = torch.arange(context - T, context)
    view = HierLayerView(
        kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero,
        fp_k=k[:, :, nq:], fp_v=v[:, :, nq:], fp_pos0=nq, group_size=G,
    )  # fmt: skip
    rows = QueryRows(torch.full((T,), nq), torch.zeros(T, dtype=torch.long), pos)
    k32, v32 = k.contiguous(), v.contiguous()
    k16, v16, q16 = k.bfloat16(), v.bfloat16(), q.bfloat16()
    mask = None
    if T > 1:
        mask = torch.arange(context)[None, :] <= pos[:, None]
    variants = {
        "fused int4": lambda: cpu_attention.hier_attention_cpu(q, view, rows, "int4"),
        "fused int8": lambda: cpu_attention.hier_attention_cpu(q, view, rows, "int8"),
        # the W4A8 draft's and the W8A8 target's: int16 queries, integer-dot scores
        "fused int4 int-q": lambda: cpu_attention.hier_attention_cpu(
            q, view, rows, "int4", None, True
        ),
        "fused int8 int-q": lambda: cpu_attention.hier_attention_cpu(
            q, view, rows, "int8", None, True
        ),
        "sdpa fp32": lambda: F.scaled_dot_product_attention(
            q, k32, v32, attn_mask=mask, enable_gqa=True
        ),
        "sdpa bf16": lambda: F.scaled_dot_product_attention(
            q16, k16, v16, attn_mask=mask, enable_gqa=True
        ),
        "reference int4": lambda: hier_attention_ref(q, view, rows, "int4"),
    }
    for fn in variants.values():  # warm up (and build the extension)
        fn()
    times = {name: [] for name in variants}
    inner = max(1, 20_000 // context)
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(_time(fn, inner))
    med = {name: statistics.median(t) for name, t in times.items()}
    hist_bytes = {  # the quantized history (planes and metadata; fp region not counted)
        "fused int4": nq * n_kv * kv_bytes_per_token(D, "int4", G, G).total,
        "fused int8": nq * n_kv * kv_bytes_per_token(D, "int8", G, G).total,
        "fused int4 int-q": nq * n_kv * kv_bytes_per_token(D, "int4", G, G).total,
        "fused int8 int-q": nq * n_kv * kv_bytes_per_token(D, "int8", G, G).total,
        "sdpa fp32": 2 * context * n_kv * D * 4,
        "sdpa bf16": 2 * context * n_kv * D * 2,
    }
    rows = {}
    for name, t in med.items():
        rows[name] = {
            "us": round(t * 1e6, 1),
            "vs_sdpa_bf16": round(med["sdpa bf16"] / t, 2),
            "vs_sdpa_fp32": round(med["sdpa fp32"] / t, 2),
            "GB_per_s": round(hist_bytes[name] / t / 1e9, 2) if name in hist_bytes else None,
        }
    return {"context": context, "T": T, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", default="2048,8192")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--queries", default="1,5", help="query lengths: 1 (draft), gamma+1 (verify)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()
    if not cpu_attention.available():
        raise SystemExit("the CPU kernel could not be built here (see the warning above)")
    results = []
    print(f"torch {torch.__version__} · {torch.get_num_threads()} threads · H {a.heads} "
          f"n_kv {a.kv_heads} D {a.dim} G {a.group} · medians of {a.repeats}")  # fmt: skip
    for context in (int(c) for c in a.context.split(",")):
        for T in (int(t) for t in a.queries.split(",")):
            r = bench(context, a.heads, a.kv_heads, a.dim, a.group, T, a.repeats)
            results.append(r)
            print(f"\ncontext {context}, {T} quer{'y' if T == 1 else 'ies'}")
            for name, row in r["rows"].items():
                gbs = f"{row['GB_per_s']:6.2f} GB/s" if row["GB_per_s"] else ""
                print(f"  {name:16s} {row['us']:9.1f} us  {row['vs_sdpa_bf16']:5.2f}x vs bf16 "
                      f"{row['vs_sdpa_fp32']:5.2f}x vs fp32  {gbs}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
