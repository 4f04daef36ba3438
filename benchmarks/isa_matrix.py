"""Every CPU stage under every instruction-set build this CPU runs, beside torch's own path in the
same process: the ratios, and each build's own ceilings.

    python benchmarks/isa_matrix.py [--isa all] [--quick] [--guard 0.5] [--json out.json]

An AVX-512 machine runs the AVX2 (and AVX-VNNI, and portable) builds too (`QSPEC_CPU_ISA`), so
the speed AVX2-only and older CPUs get is measured here, not assumed. Each build runs in its own
process (`--worker ISA`): it loads (compiling it the first time: 1-2 minutes) and times, taking
turns so a busy moment slows both alike, best of the repeats:

    prefill attention   one 512-row causal chunk after 1,536 keys (SmolLM2's 9 heads, 3 KV
                        heads, D 64): the tiled kernel's fp32 products, and the products this
                        build measures fastest, against SDPA (`kernels.reference`)
    prefill linear      W8A8 [512, 576] x [1536, 576]: the GEMM (`w8a8_linear`) against torch's
                        fp32 GEMM on the dequantized weight (the same numbers to rounding: the
                        INT8 prefill choice's "fp32" path)
    decode linear       W8A8, 1 and 5 rows, x [2048] -> [8192] (Llama-3.2-1B's MLP, 16 MB of
                        int8 weights): the row kernel against F.linear on the dequantized weight
    decode attention    1 query row over a 2k-token hierarchical cache, INT8 view: the fused
                        kernel against the PyTorch reference (dequantize, then attend)

and its ceilings, from a probe compiled with the build's own flags (g++, OpenMP, the threads
torch runs): fp32 multiply-adds (FMA where the build has it) and int8 products
(`vpdpbusd` with AVX-512 VNNI or AVX-VNNI, `vpmaddubsw` + `vpmaddwd` with AVX2). `--guard R`
exits 1 if any stage of any build runs below R x torch's path (CI runs `--quick --guard 0.5`:
a cliff, not a timing test), the stages as a run takes them: the products and the INT8 prefill
path each build measures fastest; the tiled fp32 kernel and the W8A8 GEMM alone are shown
beside them, not guarded (a measured choice passes them over where torch is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANTS = ("native", "avx2", "avxvnni", "generic")

# The ceiling probe: independent accumulator chains, so the rate is the pipes', not a latency's.
PROBE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <omp.h>
#include <chrono>
#if defined(__AVX512F__)
#include <immintrin.h>
typedef float vf __attribute__((vector_size(64)));
#elif defined(__AVX__)
#include <immintrin.h>
typedef float vf __attribute__((vector_size(32)));
#else
typedef float vf __attribute__((vector_size(16)));
#endif
constexpr int LANES = sizeof(vf) / 4, CHAINS = 12;
static double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
template <class F> static double rate(double ops_per_iter, long iters, F body) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = seconds();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    sink += body(iters / omp_get_num_threads());
    const double t = seconds() - t0;
    if (sink == 12345.f) std::printf(" ");
    best = std::max(best, ops_per_iter * double(iters) / t);
  }
  return best;
}
int main() {
  const double fp32 = rate(2.0 * LANES * CHAINS, 40000000, [](long n) {
    vf a[CHAINS], b = vf{} + 1.0000001f, c = vf{} + 1e-7f;
    for (int i = 0; i < CHAINS; ++i) a[i] = vf{} + float(i);
    for (long k = 0; k < n; ++k)
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) a[i] = a[i] * b + c;
    float s = 0;
    for (int i = 0; i < CHAINS; ++i) s += a[i][0];
    return s;
  });
  double int8 = 0;
  const char* how = "none";
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  how = "vpdpbusd zmm";
  int8 = rate(2.0 * 64 * CHAINS, 40000000, [](long n) {
    __m512i a[CHAINS], x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(2);
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_set1_epi32(i);
    for (long k = 0; k < n; ++k)
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
    int s = 0;
    for (int i = 0; i < CHAINS; ++i) s += _mm512_cvtsi512_si32(a[i]);
    return float(s);
  });
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
  how = "vpdpbusd ymm";
#define QSPEC_DOT(a, x, y) _mm256_dpbusd_avx_epi32(a, x, y)
#else
  how = "vpmaddubsw+vpmaddwd+vpaddd ymm";
#define QSPEC_DOT(a, x, y) \
  _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)))
#endif
  int8 = rate(2.0 * 32 * CHAINS, 40000000, [](long n) {
    __m256i a[CHAINS], x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(2);
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm256_set1_epi32(i);
    for (long k = 0; k < n; ++k)
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) a[i] = QSPEC_DOT(a[i], x, y);
    int s = 0;
    for (int i = 0; i < CHAINS; ++i) s += _mm256_extract_epi32(a[i], 0);
    return float(s);
  });
#endif
  std::printf("{\"fp32_gflop_s\": %.1f, \"int8_gop_s\": %.1f, \"int8_by\": \"%s\", "
              "\"lanes\": %d}\n", fp32 / 1e9, int8 / 1e9, how, LANES);
}
"""


def runnable(variants=VARIANTS) -> dict[str, str | None]:
    """{variant: None if this CPU runs it, else why not}."""
    from kernels.cpu import build as cpu_ext

    usable = cpu_ext.cpu_features().usable
    out = {}
    for isa in variants:
        needs = cpu_ext.ISA_NEEDS.get(isa, ())
        missing = [f for f in needs if f not in usable]
        lacking = needs and (not cpu_ext._X86 or missing)  # (generic: every CPU's build)
        out[isa] = f"lacks {', '.join(missing) or 'x86-64'}" if lacking else None
    return out


def ceilings(isa: str, threads: int) -> dict:
    """The probe compiled with `isa`'s flags, run on `threads` threads."""
    from kernels.cpu import build as cpu_ext

    flags = [f for f in cpu_ext.compile_flags(isa) if f.startswith("-m")]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text(PROBE)
        built = subprocess.run(
            [cpu_ext._cxx(), "-O2", "-std=c++17", "-fopenmp", *flags, str(src), "-o", str(exe)],
            capture_output=True,
            text=True,
        )
        if built.returncode:
            return {"error": built.stderr.strip().splitlines()[-1:]}
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run([str(exe)], capture_output=True, text=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])


def _best(fns: dict, repeats: int, inner: int = 1) -> dict[str, float]:
    """Seconds per call of each of `fns`, best of `repeats`, taken in turns."""
    for fn in fns.values():
        fn()  # (warm-up)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / inner)
    return best


def stages(repeats: int) -> list[dict]:
    """Each stage's qspec path and torch's, timed side by side in this process (see the doc)."""
    import torch
    import torch.nn.functional as F

    from kernels.cpu import attention as cpu_attention
    from kernels.cpu import linear as cpu_linear
    from kernels.formats import quantize_activations
    from kernels.planes import HierLayerView, QueryRows, quantize_keys, quantize_values
    from kernels.reference import causal_attention, hier_attention_ref
    from qspec_core.bench.compute import attention_flops
    from qspec_core.runner import prefill_choice
    from qspec_core.runner.products_choice import prefill_products

    g = torch.Generator().manual_seed(0)
    rows = []

    def row(stage, ours, theirs, flops=None, bytes_=None, guarded=True, **extra):
        """`guarded`: what a run takes (a measured choice, or the one kernel a stage has); a
        kernel that a measured choice may pass over is shown, not guarded."""
        r = {"stage": stage, "qspec_s": ours, "torch_s": theirs, "ratio": theirs / ours}
        r["guarded"] = guarded
        if flops:
            r["gflop_s"] = flops / ours / 1e9
        if bytes_:
            r["gb_s"] = bytes_ / ours / 1e9
        rows.append({**r, **extra})

    # prefill attention: a 512-row chunk after 1,536 keys, SmolLM2's heads
    H, n_kv, D, T, start = 9, 3, 64, 512, 1536
    q = torch.randn(1, H, T, D, generator=g)
    k, v = (torch.randn(1, n_kv, start + T, D, generator=g) for _ in range(2))
    pos = torch.arange(start, start + T)
    chosen = prefill_products()
    fns = {
        "fp32": lambda: cpu_attention.prefill_attention(q, k, v, start, "fp32"),
        "sdpa": lambda: causal_attention(q, k, v, pos),
    }
    if chosen not in fns:
        fns[chosen] = lambda: cpu_attention.prefill_attention(q, k, v, start, chosen)
    t = _best(fns, repeats)
    flops = attention_flops(D, H, T, start)
    row("prefill attention fp32", t["fp32"], t["sdpa"], flops, guarded=False)
    row("prefill attention, measured products", t[chosen], t["sdpa"], flops, products=chosen)

    # prefill linear, W8A8
    M, K, N = 512, 576, 1536
    x = torch.randn(M, K, generator=g)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, generator=g) / 127
    dequantized = w.float() * scale[:, None]
    t = _best(
        {
            "gemm": lambda: cpu_linear.w8a8_linear(x, w, scale, None),
            "torch": lambda: quantize_activations(x) @ dequantized.t(),
        },
        repeats,
    )
    row("prefill linear w8a8", t["gemm"], t["torch"], 2 * M * K * N, guarded=False)
    # the path the INT8 prefill takes here (`runner/prefill_choice.py`) against its torch "fp32"
    paths = prefill_choice._products(M, K, N)
    path = prefill_choice.prefill_path()
    t = _best({path: paths[path], "fp32": paths["fp32"]}, repeats)
    row("prefill linear, measured path", t[path], t["fp32"], 2 * M * K * N, products=path)

    # decode linears, W8A8: bandwidth-bound (16 MB of int8 weights against torch's 64 MB fp32)
    K, N = 2048, 8192
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, generator=g) / 127
    dequantized = w.float() * scale[:, None]
    for m in (1, 5):
        x = torch.randn(m, K, generator=g)
        t = _best(
            {
                "rows": lambda x=x: cpu_linear.w8a8_linear(x, w, scale, None),
                "torch": lambda x=x: F.linear(quantize_activations(x), dequantized),
            },
            repeats * 3,
        )
        row(f"decode linear w8a8, {m} row{'s' * (m > 1)}", t["rows"], t["torch"], bytes_=N * K)

    # decode attention: one row over a 2k-token cache, the INT8 view
    S, G = 2048, 64
    nq = (S // G - 1) * G
    k, v = (torch.randn(1, n_kv, S, D, generator=g) for _ in range(2))
    kq, vq = quantize_keys(k[:, :, :nq], G), quantize_values(v[:, :, :nq], G)
    view = HierLayerView(
        kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower, vq.scale, vq.zero,
        fp_k=k[:, :, nq:], fp_v=v[:, :, nq:], fp_pos0=nq, group_size=G,
    )  # fmt: skip
    q = torch.randn(1, H, 1, D, generator=g)
    one = QueryRows(torch.full((1,), nq), torch.zeros(1, dtype=torch.long), torch.tensor([S - 1]))
    t = _best(
        {
            "fused": lambda: cpu_attention.hier_attention_cpu(q, view, one, "int8"),
            "torch": lambda: hier_attention_ref(q, view, one, "int8"),
        },
        repeats * 3,
    )
    row("decode attention int8, 2k", t["fused"], t["torch"])
    return rows


def worker(isa: str, repeats: int) -> None:
    """One build's figures as one JSON line (run under QSPEC_CPU_ISA=isa)."""
    import torch

    from kernels.cpu import build as cpu_ext

    if cpu_ext.load() is None:
        print(json.dumps({"isa": isa, "error": cpu_ext.failure()}))
        return
    threads = torch.get_num_threads()
    out = {"isa": cpu_ext.isa(), "threads": threads, "ceilings": ceilings(isa, threads)}
    out["stages"] = stages(repeats)
    print(json.dumps(out))


def run_variant(isa: str, repeats: int) -> dict:
    env = {**os.environ, "QSPEC_CPU_ISA": isa}
    env.pop("QSPEC_CPU_KERNELS", None)
    done = subprocess.run(
        [sys.executable, __file__, "--worker", isa, "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"isa": isa, "error": (done.stderr.strip() or "no output")[-2000:]}
    return json.loads(lines[-1])


def render(results: list[dict], cpu: str) -> str:
    ok = [r for r in results if "stages" in r]
    out = [f"CPU: {cpu}; threads: {ok[0]['threads'] if ok else '?'}", ""]
    out.append("| build | fp32 ceiling GFLOP/s | int8 ceiling GOP/s (by) |")
    out.append("|---|---|---|")
    for r in ok:
        c = r["ceilings"]
        out.append(
            f"| {r['isa']} | {c.get('fp32_gflop_s', '-')} | "
            f"{c.get('int8_gop_s', '-')} ({c.get('int8_by', '-')}) |"
        )
    out += ["", "Each cell: qspec's time, its ratio to torch's path in the same process (x), and"]
    out += [
        "its rate where it has one; * a kernel a measured choice may pass over (not guarded).",
        "",
    ]
    names = [s["stage"] for s in ok[0]["stages"]] if ok else []
    out.append("| stage | " + " | ".join(r["isa"] for r in ok) + " |")
    out.append("|---|" + "---|" * len(ok))
    for i, name in enumerate(names):
        cells = []
        for r in ok:
            s = r["stages"][i]
            rate = f", {s['gflop_s']:.0f} GFLOP/s" if "gflop_s" in s else ""
            rate += f", {s['gb_s']:.1f} GB/s" if "gb_s" in s else ""
            rate += f", {s['products']}" if "products" in s else ""
            cells.append(f"{s['qspec_s'] * 1e3:.2f} ms ({s['ratio']:.2f}x{rate})")
        mark = "" if ok[0]["stages"][i]["guarded"] else " *"
        out.append(f"| {name}{mark} | " + " | ".join(cells) + " |")
    for r in results:
        if "error" in r:
            out.append(f"\n{r['isa']}: {r['error']}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--isa", default="all", help="all, or variants: native,avx2,avxvnni,generic")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 repeats (CI's guard)")
    ap.add_argument("--guard", type=float, help="exit 1 if a stage runs below this x torch's")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    if args.worker:
        worker(args.worker, repeats)
        return
    from qspec_core.machine_choice import cpu_description

    asked = VARIANTS if args.isa == "all" else tuple(s.strip() for s in args.isa.split(","))
    unknown = set(asked) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    results = []
    for isa, why in runnable(asked).items():
        if why:
            print(f"{isa}: skipped ({why})", file=sys.stderr)
            continue
        print(f"{isa}: timing", file=sys.stderr, flush=True)
        results.append(run_variant(isa, repeats))
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpu_description().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    print(render(results, cpu))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "builds": results}, indent=1) + "\n")
    failed = [r["isa"] for r in results if "error" in r]
    cliffs = [
        f"{r['isa']}: {s['stage']} at {s['ratio']:.2f}x torch's path"
        for r in results
        for s in r.get("stages", [])
        if args.guard is not None and s["guarded"] and s["ratio"] < args.guard
    ]
    for line in cliffs:
        print(f"cliff: {line}", file=sys.stderr)
    if failed or cliffs:
        sys.exit(1)


if __name__ == "__main__":
    main()
