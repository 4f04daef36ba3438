"""GPU check of the hierarchical-cache kernels: correctness at Llama-7B shapes, timings, and a
projected end-to-end speculative speedup.

Written for one unattended run on a lent GPU (about 8 minutes, no debugging there): every
item is guarded, results are written after each item, and on CUDA each section runs in its
own process with a time limit, so a crash (an illegal address poisons the CUDA context) or a
hang costs one section, not the report.

    python benchmarks/device_check.py --out $OUT              # CUDA: ~7 min, all sections
    python benchmarks/device_check.py --dry-run --out /tmp/x  # CPU, TRITON_INTERPRET=1, tiny

Writes device_check.json and device_check.md under --out (default: $OUT, else ".").
Sections: env, correctness (Triton vs the PyTorch twin), attention (draft / target view vs
bf16 SDPA vs dequantize-then-SDPA at 4k/32k/128k tokens, GB/s vs the H200's 4.8 TB/s),
w4a16 (vs a bf16 matmul), model_step (a timing projection of a 7B-shaped draft step, verify
step and autoregressive step: per layer the seven GEMMs plus attention, no norms/rope), and
kv_pack (quantize-and-pack vs kv_quant). Uses only torch, triton and this repository.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script from anywhere

PEAK_GBPS = 4800.0  # H200 HBM3e
SECTIONS = ("env", "correctness", "attention", "w4a16", "model_step", "kv_pack")
# Seconds each section may take on CUDA (its process is killed after), in run order.
SECTION_BUDGET_S = {
    "env": 30,
    "correctness": 90,
    "attention": 110,
    "w4a16": 40,
    "model_step": 150,
    "kv_pack": 40,
}


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    heads: int  # query heads
    kv_heads: tuple[int, ...]
    head_dim: int
    group: int  # KV quantization group G
    check_length: int  # correctness context (crosses a group boundary for T = 5)
    chunks: tuple[int | None, ...]  # chunk sizes checked (None: the default)
    lengths: tuple[int, ...]  # attention timing contexts
    queries: tuple[int, ...]  # T: 1 for a draft step, 5 for a verify (gamma = 4)
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    weight_group: int  # W4A16 group
    gemm_shapes: tuple[tuple[int, int], ...]  # (K, N): y[M, N] = x[M, K] W^T
    gemm_rows: tuple[int, ...]  # M
    pack_tokens: tuple[int, ...]
    pack_kv_heads: int
    model_lengths: tuple[int, ...]
    model_kv_heads: tuple[int, ...]
    distinct_layers: int = 2  # weight/cache sets cycled over the layers (each exceeds L2)


REAL = Settings(
    device="cuda", dtype="bfloat16", heads=32, kv_heads=(8, 32), head_dim=128, group=128,
    check_length=4094, chunks=(None, 1000), lengths=(4096, 32768, 131072), queries=(1, 5),
    layers=32, hidden=4096, intermediate=11008, vocab=32000, weight_group=128,
    gemm_shapes=((4096, 4096), (4096, 11008), (11008, 4096)), gemm_rows=(1, 5),
    pack_tokens=(128, 4096), pack_kv_heads=32, model_lengths=(4096, 32768, 131072),
    model_kv_heads=(8, 32),
)  # fmt: skip
DRY = Settings(
    device="cpu", dtype="bfloat16", heads=4, kv_heads=(2,), head_dim=64, group=32,
    check_length=94, chunks=(None, 40), lengths=(96,), queries=(1, 5),
    layers=1, hidden=256, intermediate=256, vocab=256, weight_group=128,
    gemm_shapes=((256, 256),), gemm_rows=(1, 5),
    pack_tokens=(64,), pack_kv_heads=2, model_lengths=(96,), model_kv_heads=(1,),
    distinct_layers=1,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Report: partial results on disk after every item


class Report:
    def __init__(self, out: Path, deadline: float):
        self.out = out
        self.deadline = deadline
        self.data: dict = {"errors": [], "skipped": []}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def item(self, name: str, min_seconds: float = 0.0):
        """Run one item: errors are recorded (and printed), never raised; items that would
        start with less than min_seconds left are skipped."""
        if self.time_left() < min_seconds:
            self.data["skipped"].append(name)
            print(f"[skip] {name}: out of time", flush=True)
            self.save_part()
            yield False
            return
        t0 = time.monotonic()
        try:
            yield True
            print(f"[ok] {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as exc:  # the point is to keep going
            self.data["errors"].append(
                {
                    "item": name,
                    "error": repr(exc)[:500],
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
            print(f"[error] {name}: {exc!r}"[:400], flush=True)
            _cuda_cleanup()
        finally:
            self.save_part()

    def save_part(self, name: str = "part.json") -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / name).write_text(json.dumps(self.data, indent=1, default=str))


def _cuda_cleanup() -> None:
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Timing


def bench_ms(fn, s: Settings) -> float:
    """Median milliseconds per call. CUDA: triton's do_bench (flushes L2 between calls, as the
    other layers would), else CUDA events. CPU (dry run): one call (the interpreter has
    nothing to warm up, and its times mean nothing)."""
    if s.device == "cuda":
        import triton.testing

        try:
            return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
        except Exception:  # an older or odd triton: time it by hand
            return _event_ms(fn, reps=20)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _event_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, reps: int = 10) -> float:
    """Milliseconds per replay of fn captured in a CUDA graph (no host launch overhead)."""
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _event_ms(graph.replay, reps)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# A cache state of a given length


def cache_state(length: int, T: int, G: int) -> dict:
    """Lengths and per-query indices after appending T tokens to a cache of `length`
    confirmed tokens (hier_cache's rule): history [0, n_quant), fp region of F tokens from
    n_quant; queries past n_quant + 2G are "late" and see F1 as history."""
    n_quant = max(0, (length // G - 1) * G)
    pos = length + torch.arange(T)
    late = ((pos // G - 1) * G).clamp(min=0) > n_quant
    return {
        "n_quant": n_quant,
        "F": length + T - n_quant,
        "input_pos": pos,
        "n_quant_q": n_quant + G * late.long(),
        "fp_lo": G * late.long(),
    }


def random_cache(s: Settings, n_kv: int, length: int, T: int, exact: bool, seed: int = 0):
    """hier_attention's arguments (all but view) for one layer at `length`. exact: planes
    quantized from random K/V with kv_quant (for correctness); else random bytes and scales
    (for timing, where only the bytes read matter)."""
    from kernels.planes import quantize_keys, quantize_values

    dev, dtype, D, G = s.device, getattr(torch, s.dtype), s.head_dim, s.group
    st = cache_state(length, T, G)
    S = st["n_quant"] + 2 * G  # room for F1 seen as history by late queries
    gen = torch.Generator(device=dev).manual_seed(seed)
    if exact:
        spread = 0.5 + 3 * torch.rand(D, device=dev, generator=gen)
        k = torch.randn(1, n_kv, S, D, device=dev, generator=gen) * spread + spread
        kq, vq = quantize_keys(k, G), quantize_values(torch.randn_like(k), G)
        planes = (kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero)
    else:

        def byte():  # [1, n_kv, S, D/2] packed nibbles
            return torch.randint(0, 256, (1, n_kv, S, D // 2), device=dev, dtype=torch.uint8)

        def small(*shape):
            return torch.rand(*shape, device=dev, generator=gen) * 0.1

        k_meta, v_meta = (1, n_kv, S // G, D), (1, n_kv, S, D // G)
        planes = (byte(), byte(), small(*k_meta), small(*k_meta))
        planes += (byte(), byte(), small(*v_meta), small(*v_meta))
    fp = torch.randn(2, 1, n_kv, st["F"], D, device=dev, generator=gen).to(dtype)
    q = torch.randn(1, s.heads, T, D, device=dev, generator=gen).to(dtype)
    names = ("k_upper", "k_lower", "k_scale", "k_zero", "v_upper", "v_lower", "v_scale", "v_zero")
    args = dict(zip(names, planes, strict=True))
    args.update(q=q, fp_k=fp[0], fp_v=fp[1], fp_pos0=st["n_quant"], group_size=G)
    args.update(n_quant_q=st["n_quant_q"], fp_lo=st["fp_lo"], input_pos=st["input_pos"])
    return args


def history_bytes(s: Settings, n_kv: int, length: int, T: int, view: str) -> float:
    """Bytes a view must read: packed planes and metadata of the history, plus the fp region."""
    from kernels.planes import kv_bytes_per_token

    st = cache_state(length, T, s.group)
    per_token = kv_bytes_per_token(s.head_dim, view, s.group, s.group).total * n_kv
    n_hist = int(st["n_quant_q"].max())
    fp_bytes = 2 * n_kv * st["F"] * s.head_dim * 2
    return per_token * n_hist + fp_bytes


# ---------------------------------------------------------------------------------------------
# Sections


def section_env(s: Settings, report: Report) -> None:
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "device": s.device,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    report.data["env"] = env
    print(json.dumps(env), flush=True)


def _check_attention(s: Settings, args: dict, view: str) -> list[dict]:
    """Triton vs the twin (fp32 q) on one cache: default and explicit chunks, and on CUDA
    the default (tf32) and ieee dots. ok: max error within 1% of the output's max."""
    from kernels.triton.hier_attention import hier_attention_launcher, hier_attention_ref

    ref = hier_attention_ref(**{**args, "q": args["q"].float()}, view=view)
    ref_max = ref.abs().max().item()
    variants = [(chunk, None) for chunk in s.chunks]
    if s.device == "cuda":
        variants.append((None, "ieee"))
    rows = []
    for chunk, precision in variants:
        run = hier_attention_launcher(**args, view=view, chunk_size=chunk, dot_precision=precision)
        err = (run().float() - ref).abs().max().item()
        rows.append(
            {
                "n_kv": args["k_upper"].shape[1], "T": args["q"].shape[2], "view": view,
                "chunk": chunk or "default", "precision": precision or "default",
                "late_queries": int((args["fp_lo"] > 0).sum()),
                "max_abs_err": err, "ref_max": ref_max, "ok": bool(err <= 1e-2 * ref_max + 1e-4),
            }
        )  # fmt: skip
    return rows


def _check_kv_pack(s: Settings) -> list[dict]:
    """quantize_*_triton vs kv_quant: mismatching elements per field (0 expected)."""
    from kernels.triton.kv_pack import quantize_keys_triton, quantize_values_triton
    from kernels.planes import quantize_keys, quantize_values

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
    (T = 5 crosses a group boundary: late queries); kv_pack vs kv_quant bit for bit."""
    rows = report.data.setdefault("correctness", [])
    for n_kv in s.kv_heads:
        for T in s.queries:
            args = random_cache(s, n_kv, s.check_length, T, exact=True, seed=n_kv + T)
            for view in ("draft", "target"):
                with report.item(f"correctness n_kv={n_kv} T={T} {view}", 5) as go:
                    if go:
                        rows += _check_attention(s, args, view)
    with report.item("correctness kv_pack", 5) as go:
        if go:
            rows += _check_kv_pack(s)


def _attention_variants(s: Settings, args: dict):
    """name -> (zero-argument callable, bytes it must read)."""
    from kernels.triton.hier_attention import hier_attention_launcher
    from kernels.planes import QuantizedGroupTensor, dequantize_keys, dequantize_values

    q, G = args["q"], s.group
    n_hist = int(args["n_quant_q"].max())
    n_kv, D = args["fp_k"].shape[1], s.head_dim
    length = int(args["input_pos"][0])
    T = q.shape[2]
    dense = torch.randn(2, 1, n_kv, length + T, D, device=q.device).to(q.dtype)  # bf16 cache

    def sdpa():
        return F.scaled_dot_product_attention(q, dense[0], dense[1], enable_gqa=n_kv != q.shape[1])

    def dequant_sdpa():  # what a kernel-less implementation does: materialize, then attend
        k = QuantizedGroupTensor(
            args["k_upper"][:, :, :n_hist], args["k_lower"][:, :, :n_hist],
            args["k_scale"][:, :, : n_hist // G], args["k_zero"][:, :, : n_hist // G],
        )  # fmt: skip
        v = QuantizedGroupTensor(
            args["v_upper"][:, :, :n_hist], args["v_lower"][:, :, :n_hist],
            args["v_scale"][:, :, :n_hist], args["v_zero"][:, :, :n_hist],
        )  # fmt: skip
        keys = torch.cat((dequantize_keys(k, G, "target").to(q.dtype), args["fp_k"]), dim=2)
        values = torch.cat((dequantize_values(v, G, "target").to(q.dtype), args["fp_v"]), dim=2)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=n_kv != q.shape[1])

    dense_bytes = 2 * n_kv * (length + T) * D * 2
    draft_bytes = history_bytes(s, n_kv, length, T, "draft")
    target_bytes = history_bytes(s, n_kv, length, T, "target")
    return {
        "draft": (hier_attention_launcher(**args, view="draft"), draft_bytes),
        "target": (hier_attention_launcher(**args, view="target"), target_bytes),
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
                    args = random_cache(s, n_kv, length, T, exact=False)
                    row = {"length": length, "n_kv": n_kv, "T": T, "ms": {}, "gbps": {}}
                    rows.append(row)
                    for name, (fn, nbytes) in _attention_variants(s, args).items():
                        try:
                            ms = bench_ms(fn, s)
                        except Exception as exc:  # one variant, keep the rest
                            row.setdefault("variant_errors", {})[name] = repr(exc)[:300]
                            _cuda_cleanup()
                            continue
                        row["ms"][name] = ms
                        row["gbps"][name] = gbps(nbytes, ms)
                    row["pct_of_peak"] = {k: 100 * v / PEAK_GBPS for k, v in row["gbps"].items()}
                    del args
                    _cuda_cleanup()


def _int4_weight(n: int, k: int, s: Settings, dev: str):
    """Random packed 4-bit weight [N, K/2] with bf16 scale/zero [N, K/G]."""
    dtype = getattr(torch, s.dtype)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    scale = (torch.rand(n, k // s.weight_group, device=dev) * 0.01).to(dtype)
    zero = torch.full((n, k // s.weight_group), 8.0, device=dev).to(dtype)
    return packed, scale, zero


def section_w4a16(s: Settings, report: Report) -> None:
    from kernels.triton.w4a16 import w4a16_matmul

    rows = report.data.setdefault("w4a16", [])
    dtype = getattr(torch, s.dtype)
    for k, n in s.gemm_shapes:
        with report.item(f"w4a16 K={k} N={n}", 5) as go:
            if not go:
                continue
            packed, scale, zero = _int4_weight(n, k, s, s.device)
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
    from kernels.triton.kv_pack import quantize_keys_triton, quantize_values_triton
    from kernels.planes import quantize_keys, quantize_values

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


# ---------------------------------------------------------------------------------------------
# Model step projection


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
            weights = [_int4_weight(n, k, s, dev) for k, n in shapes]
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
            args = random_cache(s, n_kv, length, T, exact=False, seed=layer)
            attend = hier_attention_launcher(**args, view=view)
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
                            _cuda_cleanup()
                    row["gbps"][kind] = gbps(nbytes, row["ms"][kind])
                    del step
                    _cuda_cleanup()
                ms = row["ms"]
                round_cost = (gamma * ms["draft"] + ms["verify"]) / ms["ar"]
                row["projected_speedup"] = block["tokens_per_round"] / round_cost
                speedups[f"L={length},n_kv={n_kv}"] = row["projected_speedup"]


def _eager_ms(step, s: Settings) -> float:
    if s.device == "cuda":
        return _event_ms(step, reps=3)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _attention_cell(row: dict, variant: str) -> str:
    if variant not in row.get("ms", {}):
        return "-"
    ms, rate = row["ms"][variant], row["gbps"][variant]
    return f"{ms:.4g} / {rate:.0f} / {100 * rate / PEAK_GBPS:.0f}%"


def render_markdown(data: dict) -> str:
    out = ["# Device check: hierarchical-cache kernels", ""]
    out += ["## Environment", "", "```", json.dumps(data.get("env", {}), indent=1), "```", ""]
    corr = data.get("correctness", [])
    attn_rows = [r for r in corr if "view" in r]
    if attn_rows:
        out += ["## Correctness (Triton vs twin, fp32 reference)", ""]
        out += _table(
            ["n_kv", "T", "view", "chunk", "dot", "late q", "max err", "max |ref|", "ok"],
            [
                [r["n_kv"], r["T"], r["view"], r["chunk"], r["precision"], r["late_queries"]]
                + [r["max_abs_err"], r["ref_max"], r["ok"]]
                for r in attn_rows
            ],
        ) + [""]
    for r in (r for r in corr if "kv_pack" in r):
        out.append(f"- kv_pack {r['kv_pack']}: mismatches {r['mismatches']}, ok {r['ok']}")
    variants = ("draft", "target", "sdpa_bf16", "dequant_sdpa")
    if data.get("attention"):
        out += ["", f"## Attention (ms / GB/s / % of {PEAK_GBPS:.0f} GB/s)", ""]
        rows = [
            [r["length"], r["n_kv"], r["T"], *(_attention_cell(r, v) for v in variants)]
            for r in data["attention"]
        ]
        out += _table(["L", "n_kv", "T", *variants], rows) + [""]
    if data.get("w4a16"):
        out += ["## W4A16 vs bf16 matmul", ""]
        keys = ("K", "N", "M", "w4a16_ms", "bf16_ms", "w4a16_gbps", "bf16_gbps", "speedup")
        out += _table(list(keys), [[r[k] for k in keys] for r in data["w4a16"]]) + [""]
    step = data.get("model_step", {})
    if step.get("rows"):
        out += [f"## Model step ({step['label']})", ""]
        out.append(
            f"acceptance {step['acceptance']}, gamma {step['gamma']}, "
            f"tokens per round {step['tokens_per_round']:.3f}; "
            "speedup = tokens per round / ((gamma * draft + verify) / ar)"
        )
        out += [""] + _table(
            ["L", "n_kv", "ar ms", "draft ms", "verify ms", "method", "projected speedup"],
            [
                [r["length"], r["n_kv"], *(r["ms"].get(k, "-") for k in ("ar", "draft", "verify"))]
                + ["/".join(sorted(set(r["method"].values()))), r.get("projected_speedup", "-")]
                for r in step["rows"]
            ],
        ) + [""]  # fmt: skip
    if data.get("kv_pack"):
        out += ["## kv_pack (quantize + pack) vs kv_quant", ""]
        keys = ("tokens", "kv_heads", "kind", "triton_ms", "torch_ms", "triton_gbps", "speedup")
        out += _table(list(keys), [[r[k] for k in keys] for r in data["kv_pack"]]) + [""]
    if data.get("errors"):
        out += ["## Errors", ""] + [f"- {e['item']}: {e['error']}" for e in data["errors"]]
    if data.get("skipped"):
        out += ["", "Skipped (out of time): " + ", ".join(data["skipped"])]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Driver


def run_section(name: str, s: Settings, report: Report, args) -> None:
    if name == "env":
        with report.item("env") as go:
            if go:
                section_env(s, report)
    elif name == "model_step":
        section_model_step(s, report, args.acceptance, args.gamma)
    else:
        globals()[f"section_{name}"](s, report)


def _merge(total: dict, part: dict) -> None:
    for key, value in part.items():
        if key in ("errors", "skipped"):
            total.setdefault(key, []).extend(value)
        else:
            total[key] = value


def write_outputs(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(data, indent=1, default=str))
    try:
        text = render_markdown(data)
    except Exception:  # a partial row must not cost the JSON or the file
        text = "# Device check\n\nrendering failed:\n```\n" + traceback.format_exc() + "```\n"
    (out / "device_check.md").write_text(text)


def run_isolated(out: Path, args, deadline: float) -> dict:
    """Each section in its own process with a time limit; merge what each one left."""
    data: dict = {"errors": [], "skipped": []}
    for name in args.sections:
        left = deadline - time.monotonic()
        if left < 10:
            data["skipped"].append(name)
            continue
        budget = min(SECTION_BUDGET_S[name], left)
        part = out / "parts" / name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(part), "--section"]
        cmd += [name, "--budget-s", str(budget - 5), "--acceptance", str(args.acceptance)]
        cmd += ["--gamma", str(args.gamma)] + (["--dry-run"] if args.dry_run else [])
        print(f"== section {name} (limit {budget:.0f} s)", flush=True)
        try:
            result = subprocess.run(cmd, timeout=budget, capture_output=True, text=True)
            sys.stdout.write(result.stdout[-4000:])
            if result.returncode != 0:
                data["errors"].append(
                    {"item": f"section {name}", "error": f"exit {result.returncode}",
                     "traceback": result.stderr[-3000:]}
                )  # fmt: skip
        except subprocess.TimeoutExpired:
            data["errors"].append({"item": f"section {name}", "error": "timed out"})
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            _merge(data, json.loads((part / "part.json").read_text()))
        write_outputs(out, data)
    return data


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--acceptance", type=float, default=0.58)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--section", choices=SECTIONS, help="(internal) run one section here")
    ap.add_argument(
        "--isolate",
        choices=("auto", "yes", "no"),
        default="auto",
        help="one process per section (auto: on CUDA)",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    deadline = time.monotonic() + args.budget_s
    settings = DRY if args.dry_run else REAL
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on CPU", flush=True)

    if args.section:  # a child of run_isolated
        report = Report(args.out, deadline)
        run_section(args.section, settings, report, args)
        return report.data
    isolate = args.isolate == "yes" or (args.isolate == "auto" and settings.device == "cuda")
    if isolate:
        data = run_isolated(args.out, args, deadline)
    else:
        report = Report(args.out / "parts", deadline)
        for name in args.sections:
            run_section(name, settings, report, args)
            write_outputs(args.out, {"settings": asdict(settings), **report.data})
        data = report.data
    data = {"settings": asdict(settings), **data}
    write_outputs(args.out, data)
    print((args.out / "device_check.md").read_text(), flush=True)
    print(summary_line(data), flush=True)
    return data


def summary_line(data: dict) -> str:
    """One line for the end of a log: checks passed, errors, skipped, headline speedups."""
    checks = data.get("correctness", [])
    speedups = data.get("model_step", {}).get("projected_speedup", {})
    return (
        f"SUMMARY correctness {sum(c['ok'] for c in checks)}/{len(checks)} ok; "
        f"errors {len(data.get('errors', []))}; skipped {len(data.get('skipped', []))}; "
        "projected speedup " + ", ".join(f"{k}: {v:.2f}x" for k, v in speedups.items())
    )


if __name__ == "__main__":
    main()
