"""What the prefill attention's products cost in quality and give in time, on a real model:
the same document prefilled once per product type (`QSPEC_PREFILL_PRODUCTS`), the next-token
distributions of every position of its last chunk compared with the fp32 products' (mean KL
in nats, the share of positions whose top 1 agrees), and each prefill's attention seconds.

    python benchmarks/prefill_products.py [--model smollm2-135m] [--doc qspec_core/data/gpl-3.0.txt]
        [--products fp32,bf16,bf16-values,int16] [--tokens 8192] [--json out.json]

The prefill is QuantSpec's (`ChunkedPrefill` in chunks of 512, the target's weights, the INT8
history), the document framed as `qspec summarize` frames it and cut to --tokens, then to
whole chunks (at least two, so the last one has a history); the last chunk's 512 logits are
all kept (the prefill itself keeps only the last position's). The INT8
history's own cost is the row "fp32 history": the same prompt in one chunk (all of it
attended in full precision) against the chunked fp32 products. (One position alone is a
noisy measure: on an 8k SmolLM2 prefill the last position's KL ranked the products in
another order than the 512 positions' mean.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kernels.cpu import attention as cpu_attention
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.cache.prefill import ChunkedPrefill
from qspec_core.documents import read_document
from qspec_core.engine.generate import PREFILL_CHUNK as CHUNK
from qspec_core.engine.session import ChatSession
from qspec_core.precision import FP
from qspec_core.registry.runtime import prepare_and_load


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Mean and largest KL(ref || got) over positions of logits [T, V], in nats, and the share
    of positions whose top 1 agrees."""
    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # [T]
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agree": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
    }


@torch.inference_mode()
def last_chunk_logits(
    rt, cache, ids: list[int], chunk: int, products: str
) -> tuple[torch.Tensor, float]:
    """QuantSpec's prefill of `ids` into `cache` in chunks of `chunk`, its attention on
    `products`, the last chunk's logits [T, V] kept; and the attention's seconds."""
    cache.reset()
    scratch = ChunkedPrefill(cache, chunk, products)
    path = FP.with_weights(rt.target_weights)
    tokens = torch.tensor(ids)[None]
    last = (len(ids) - 1) // chunk * chunk
    for begin in range(0, len(ids), chunk):
        pos = torch.arange(begin, min(begin + chunk, len(ids)))
        logits = rt.runner(tokens[:, begin : begin + chunk], pos, scratch, path, begin < last)
    scratch.finish()
    return logits[0].clone(), scratch.attention_seconds


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    products = args.products.split(",")
    for p in products:
        if cpu_attention.prefill_products(p) != p:  # (raises on an unknown name)
            raise ValueError(f"products {p!r} need a build with AVX512-BF16 or AVX512-VNNI")
    rt = prepare_and_load(args.model, need_draft=False, target_weights=args.target_weights)
    session = ChatSession(rt, read_document(args.doc), mode="target-ar")
    ids = session.document_prefix_ids()[: args.tokens]
    ids = ids[: len(ids) // CHUNK * CHUNK]  # (whole chunks: the last one's positions all count)
    if len(ids) < 2 * CHUNK:
        raise ValueError(f"the document gives {len(ids)} tokens in whole chunks; 2 or more needed")
    model = rt.model
    cache = HierarchicalKVCache(model.config, len(ids) + 1, dtype=model.dtype, device=model.device)
    logits, rows = {}, []
    runs = [(p, CHUNK) for p in ["fp32", *[p for p in products if p != "fp32"]]]
    if args.fp32_history:
        runs.append(("fp32 history", len(ids)))
    for name, chunk in runs:
        t0 = time.perf_counter()
        logits[name], attention = last_chunk_logits(rt, cache, ids, chunk, name.split()[0])
        row = {"products": name, "tokens": len(ids), "positions": len(logits[name])}
        row.update(prefill_s=time.perf_counter() - t0, attention_s=attention)
        # (the one-chunk run's logits are all positions: compare its last chunk's)
        row.update(compare(logits["fp32"], logits[name][-len(logits["fp32"]) :]))
        rows.append(row)
        print(
            f"{name:12s} prefill {row['prefill_s']:7.1f} s  attention {attention:6.1f} s  "
            f"KL mean {row['kl_mean']:.2e} max {row['kl_max']:.2e}  "
            f"top 1 agrees {100 * row['top1_agree']:.1f}%",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model name or folder (default: the default)")
    ap.add_argument("--doc", type=Path, default=Path("qspec_core/data/gpl-3.0.txt"))
    ap.add_argument("--products", default="fp32,bf16,bf16-values,int16")
    ap.add_argument("--tokens", type=int, default=8192, help="the prompt cut to this many tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--target-weights", default="auto", help="the target's weights, as `qspec summarize`'s"
    )
    ap.add_argument("--fp32-history", action="store_true", help="also the one-chunk prefill")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.tokens < 2 * CHUNK or args.threads < 1:
            raise ValueError(f"--tokens takes {2 * CHUNK} or more, --threads 1 or more")
        rows = run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
