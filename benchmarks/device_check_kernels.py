"""The kernel sections of device_check: correctness (Triton vs the PyTorch twin), attention
(draft / target view vs bf16 SDPA vs dequantize-then-SDPA), w4a16 (vs a bf16 matmul) and
kv_pack (quantize-and-pack vs kernels.planes). Kernel modules are imported inside each function:
a dry run sets TRITON_INTERPRET first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from device_check_harness import PEAK_GBPS, Report, Settings, bench_ms, cuda_cleanup, gbps
from device_check_inputs import KV_VIEW, history_bytes, int4_weight, random_cache


def _check_attention(s: Settings, case: tuple, view: str) -> list[dict]:
    """Triton vs the twin (fp32 q) on one cache: default and explicit chunks, and on CUDA
    the default (tf32) and ieee dots. ok: max error within 1% of the output's max."""
    from kernels.reference import hier_attention_ref
    from kernels.triton.hier_attention import hier_attention_launcher

    q, hier, queries = case
    kv = KV_VIEW[view]
    ref = hier_attention_ref(q.float(), hier, queries, kv)
    ref_max = ref.abs().max().item()
    variants = [(chunk, None) for chunk in s.chunks]
    if s.device == "cuda":
        variants.append((None, "ieee"))
    rows = []
    for chunk, precision in variants:
        run = hier_attention_launcher(
            q, hier, queries, kv, chunk_size=chunk, dot_precision=precision
        )
        err = (run().float() - ref).abs().max().item()
        rows.append(
            {
                "n_kv": hier.k_upper.shape[1], "T": q.shape[2], "view": view,
                "chunk": chunk or "default", "precision": precision or "default",
                "late_queries": int((queries.fp_lo > 0).sum()),
                "max_abs_err": err, "ref_max": ref_max, "ok": bool(err <= 1e-2 * ref_max + 1e-4),
            }
        )  # fmt: skip
    return rows


def _check_kv_pack(s: Settings) -> list[dict]:
    """quantize_*_triton vs kernels.planes: mismatching elements per field (0 expected)."""
    from kernels.planes import quantize_keys, quantize_values
    from kernels.triton.kv_pack import quantize_keys_triton, quantize_values_triton

    gen = torch.Generator(device=s.device).manual_seed(7)
    shape = (1, s.pack_kv_heads, s.pack_tokens[-1], s.head_dim)
    x = (torch.randn(*shape, device=s.device, generator=gen) * 3).to(getattr(torch, s.dtype))
    rows = []
    for name, fast, twin in (
        ("keys", quantize_keys_triton, quantize_keys),
        ("values", quantize_values_triton, quantize_values),
    ):
        got, want = fast(x, s.group), twin(x, s.group)
        fields = ("upper", "lower", "scale", "zero")
        diffs = {f: int((getattr(got, f) != getattr(want, f)).sum()) for f in fields}
        rows.append({"kv_pack": name, "mismatches": diffs, "ok": not any(diffs.values())})
    return rows


def section_correctness(s: Settings, report: Report) -> None:
    """hier_attention vs its twin at the check length for each KV head count, T and view
    (T = 5 crosses a group boundary: late queries); kv_pack vs kernels.planes bit for bit."""
    rows = report.data.setdefault("correctness", [])
    for n_kv in s.kv_heads:
        for T in s.queries:
            case = random_cache(s, n_kv, s.check_length, T, exact=True, seed=n_kv + T)
            for view in ("draft", "target"):
                with report.item(f"correctness n_kv={n_kv} T={T} {view}", 5) as go:
                    if go:
                        rows += _check_attention(s, case, view)
    with report.item("correctness kv_pack", 5) as go:
        if go:
            rows += _check_kv_pack(s)


def _attention_variants(s: Settings, case: tuple):
    """name -> (zero-argument callable, bytes it must read)."""
    from kernels.planes import QuantizedGroupTensor, dequantize_keys, dequantize_values
    from kernels.triton.hier_attention import hier_attention_launcher

    (q, hier, queries), G = case, s.group
    n_hist = int(queries.n_quant_q.max())
    n_kv, D = hier.fp_k.shape[1], s.head_dim
    length = int(queries.input_pos[0])
    T = q.shape[2]
    dense = torch.randn(2, 1, n_kv, length + T, D, device=q.device).to(q.dtype)  # bf16 cache

    def sdpa():
        return F.scaled_dot_product_attention(q, dense[0], dense[1], enable_gqa=n_kv != q.shape[1])

    def dequant_sdpa():  # what a kernel-less implementation does: materialize, then attend
        k = QuantizedGroupTensor(
            hier.k_upper[:, :, :n_hist], hier.k_lower[:, :, :n_hist],
            hier.k_scale[:, :, : n_hist // G], hier.k_zero[:, :, : n_hist // G],
        )  # fmt: skip
        v = QuantizedGroupTensor(
            hier.v_upper[:, :, :n_hist], hier.v_lower[:, :, :n_hist],
            hier.v_scale[:, :, :n_hist], hier.v_zero[:, :, :n_hist],
        )  # fmt: skip
        keys = torch.cat((dequantize_keys(k, G, "int8").to(q.dtype), hier.fp_k), dim=2)
        values = torch.cat((dequantize_values(v, G, "int8").to(q.dtype), hier.fp_v), dim=2)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=n_kv != q.shape[1])

    dense_bytes = 2 * n_kv * (length + T) * D * 2
    draft_bytes = history_bytes(s, n_kv, length, T, "draft")
    target_bytes = history_bytes(s, n_kv, length, T, "target")
    return {
        "draft": (hier_attention_launcher(q, hier, queries, KV_VIEW["draft"]), draft_bytes),
        "target": (hier_attention_launcher(q, hier, queries, KV_VIEW["target"]), target_bytes),
        "sdpa_bf16": (sdpa, dense_bytes),
        "dequant_sdpa": (dequant_sdpa, target_bytes),
    }


def section_attention(s: Settings, report: Report) -> None:
    """Per context, KV head count and T: ms, GB/s and % of peak for each variant. SDPA runs
    without a mask (the last T keys' causal detail is immaterial to its time)."""
    rows = report.data.setdefault("attention", [])
    for length in s.lengths:
        for n_kv in s.kv_heads:
            for T in s.queries:
                with report.item(f"attention L={length} n_kv={n_kv} T={T}", 8) as go:
                    if not go:
                        continue
                    case = random_cache(s, n_kv, length, T, exact=False)
                    row = {"length": length, "n_kv": n_kv, "T": T, "ms": {}, "gbps": {}}
                    rows.append(row)
                    for name, (fn, nbytes) in _attention_variants(s, case).items():
                        try:
                            ms = bench_ms(fn, s)
                        except Exception as exc:  # one variant, keep the rest
                            row.setdefault("variant_errors", {})[name] = repr(exc)[:300]
                            cuda_cleanup()
                            continue
                        row["ms"][name] = ms
                        row["gbps"][name] = gbps(nbytes, ms)
                    row["pct_of_peak"] = {k: 100 * v / PEAK_GBPS for k, v in row["gbps"].items()}
                    del case
                    cuda_cleanup()


def section_w4a16(s: Settings, report: Report) -> None:
    from kernels.triton.w4a16 import w4a16_matmul

    rows = report.data.setdefault("w4a16", [])
    dtype = getattr(torch, s.dtype)
    for k, n in s.gemm_shapes:
        with report.item(f"w4a16 K={k} N={n}", 5) as go:
            if not go:
                continue
            packed, scale, zero = int4_weight(n, k, s, s.device)
            dense = torch.randn(n, k, device=s.device).to(dtype)
            int4_bytes = n * k / 2 + 2 * n * (k // s.weight_group) * scale.element_size()
            for m in s.gemm_rows:
                x = torch.randn(m, k, device=s.device).to(dtype)
                w4 = bench_ms(lambda: w4a16_matmul(x, packed, scale, zero, s.weight_group), s)  # noqa: B023
                bf = bench_ms(lambda: F.linear(x, dense), s)  # noqa: B023
                rows.append(
                    {
                        "K": k, "N": n, "M": m, "w4a16_ms": w4, "bf16_ms": bf,
                        "w4a16_gbps": gbps(int4_bytes, w4), "bf16_gbps": gbps(2 * n * k, bf),
                        "speedup": bf / w4,
                    }
                )  # fmt: skip


def section_kv_pack(s: Settings, report: Report) -> None:
    from kernels.planes import quantize_keys, quantize_values
    from kernels.triton.kv_pack import quantize_keys_triton, quantize_values_triton

    rows = report.data.setdefault("kv_pack", [])
    dtype = getattr(torch, s.dtype)
    for tokens in s.pack_tokens:
        with report.item(f"kv_pack T={tokens}", 5) as go:
            if not go:
                continue
            x = torch.randn(1, s.pack_kv_heads, tokens, s.head_dim, device=s.device).to(dtype)
            nbytes = x.numel() * (x.element_size() + 1)  # read x, write two nibble planes
            for name, fast, twin in (
                ("keys", quantize_keys_triton, quantize_keys),
                ("values", quantize_values_triton, quantize_values),
            ):
                triton_ms = bench_ms(lambda: fast(x, s.group), s)  # noqa: B023
                torch_ms = bench_ms(lambda: twin(x, s.group), s)  # noqa: B023
                rows.append(
                    {
                        "tokens": tokens, "kv_heads": s.pack_kv_heads, "kind": name,
                        "triton_ms": triton_ms, "torch_ms": torch_ms,
                        "triton_gbps": gbps(nbytes, triton_ms), "speedup": torch_ms / triton_ms,
                    }
                )  # fmt: skip
