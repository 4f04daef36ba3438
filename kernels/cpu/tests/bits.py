"""Every C++ CPU kernel's output on fixed random inputs, saved, then compared bit for bit.

A refactor of the kernels' SIMD code (simd.h and its ISA files) must not change one bit: run
`save` with the old checkout and with the new one (the same QSPEC_CPU_ISA), then `compare`:

    PYTHONPATH=<old checkout> python kernels/cpu/tests/bits.py save old.pt
    PYTHONPATH=<new checkout> python kernels/cpu/tests/bits.py save new.pt
    python kernels/cpu/tests/bits.py compare old.pt new.pt

Covers the step linears (fp32, int8, W8A8 on 1..17 rows and on the GEMM schedule, W4A8), the
hierarchical attention (int8 and int4 views, fp32 and int16 queries), RMSNorm, the residual
add, RoPE and the prefill attention (fp32 products, and bf16 and int16 ones where the build
has them).
"""

from __future__ import annotations

import sys

import torch

from kernels.cpu import attention as cpu_attention
from kernels.cpu import build as cpu_ext
from kernels.formats import quantize_int8
from kernels.planes import HierLayerView, QueryRows, quantize_keys, quantize_values


def _linears(ext, g, out):
    for K, N in ((576, 192), (1536, 37), (64, 9), (100, 13)):
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g)
        q, scale = quantize_int8(w)
        for M in (1, 2, 3, 5, 8, 9, 16, 17):
            x = torch.randn(M, K, generator=g)
            out[f"linear K{K} N{N} M{M}"] = ext.linear_rows_cpu(x, w, b)
            out[f"linear nobias K{K} N{N} M{M}"] = ext.linear_rows_cpu(x, w, None)
            out[f"int8 K{K} N{N} M{M}"] = ext.int8_rows_cpu(x, q, scale, b)
            if K % 64 == 0:
                x[0, :64] = 0  # an all-zero chunk
                out[f"w8a8 K{K} N{N} M{M}"] = ext.w8a8_rows_cpu(x, q, scale, b)
                out[f"w8a8 nobias K{K} N{N} M{M}"] = ext.w8a8_rows_cpu(x, q, scale, None)
        if K % 64 == 0:
            for M in (18, 37, 100):  # the GEMM schedule
                x = torch.randn(M, K, generator=g)
                out[f"w8a8 gemm K{K} N{N} M{M}"] = ext.w8a8_rows_cpu(x, q, scale, b)
    for K, N, G in ((576, 192, 64), (1536, 40, 128), (128, 7, 64), (512, 64, 256)):
        qw = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        packed = (qw[:, 0::2] | (qw[:, 1::2] << 4)).contiguous()
        scale = torch.rand(N, K // G, generator=g) * 0.1
        zero = torch.randint(0, 16, (N, K // G), generator=g).float()
        b = torch.randn(N, generator=g)
        for M in (1, 2, 5, 8):
            x = torch.randn(M, K, generator=g)
            x[0, :64] = 0
            out[f"int4 K{K} N{N} G{G} M{M}"] = ext.int4_rows_cpu(x, packed, scale, zero, G, b)
            out[f"int4 nobias K{K} N{N} G{G} M{M}"] = ext.int4_rows_cpu(
                x, packed, scale, zero, G, None
            )


ATTENTION = [
    dict(D=64, G=64, n_kv=3, R=3, T=1, nq=640, F=100),
    dict(D=64, G=64, n_kv=3, R=3, T=5, nq=640, F=100, late=2),
    dict(D=128, G=128, n_kv=2, R=4, T=5, nq=1024, F=200, late=1),
    dict(D=64, G=16, n_kv=1, R=2, T=3, nq=208, F=30),
    dict(D=80, G=16, n_kv=2, R=1, T=2, nq=96, F=20),
    dict(D=80, G=80, n_kv=1, R=2, T=3, nq=240, F=90),
    dict(D=16, G=16, n_kv=2, R=2, T=17, nq=160, F=40, late=5),
    dict(D=64, G=64, n_kv=1, R=1, T=4, nq=0, F=60),
    dict(D=64, G=32, n_kv=2, R=2, T=1, nq=736, F=50, chunk=96),
]


def _attention(g, out):
    for i, c in enumerate(ATTENTION):
        D, G, n_kv, R, T, nq, F = (c[k] for k in ("D", "G", "n_kv", "R", "T", "nq", "F"))
        late, chunk = c.get("late", 0), c.get("chunk", 512)
        S = nq + 3 * G
        k = torch.randn(1, n_kv, S, D, generator=g) * 3 + 1
        v = torch.randn(1, n_kv, S, D, generator=g)
        kq, vq = quantize_keys(k, G), quantize_values(v, G)
        q = torch.randn(1, n_kv * R, T, D, generator=g)
        fp_k = torch.randn(1, n_kv, F + 7, D, generator=g)[:, :, :F]
        fp_v = torch.randn(1, n_kv, F + 7, D, generator=g)[:, :, :F]
        pos = torch.arange(nq + F - T, nq + F)
        shift = torch.zeros(T, dtype=torch.long)
        if late:
            shift[-late:] = G
        view = HierLayerView(kq.upper, kq.lower, kq.scale, kq.zero, vq.upper, vq.lower,
                             vq.scale, vq.zero, fp_k, fp_v, fp_pos0=nq, group_size=G)  # fmt: skip
        rows = QueryRows(n_quant_q=nq + shift, fp_lo=shift, input_pos=pos)
        for kv in ("int8", "int4"):
            for iq in (False, True):
                got = cpu_attention.hier_attention_cpu(q, view, rows, kv, chunk, iq)
                out[f"hier {i} {kv} int_q={iq}"] = got.contiguous()


def _small_ops(ext, g, out):
    for H in (64, 576, 100):
        x = torch.randn(5, H, generator=g)
        h = torch.randn(5, H, generator=g)
        w = torch.randn(H, generator=g)
        out[f"rms H{H}"] = ext.rms_norm_cpu(x, w, 1e-5)
        x2 = x.clone()
        out[f"add_rms H{H}"] = ext.add_rms_norm_cpu(x2, h, w, 1e-5)
        out[f"add_rms x H{H}"] = x2
    for D in (16, 64, 80, 128):
        x = torch.randn(2, 5, 3, D, generator=g)
        cos, sin = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)
        ext.rope_cpu(x, cos, sin)
        out[f"rope D{D}"] = x
    for D in (64, 80, 96, 128):
        for T, start in ((18, 0), (70, 0), (33, 100)):
            q = torch.randn(1, 4, T, D, generator=g)
            k = torch.randn(1, 2, start + T + 5, D, generator=g)
            v = torch.randn(1, 2, start + T + 5, D, generator=g)
            out[f"prefill D{D} T{T} s{start}"] = ext.prefill_attention_cpu(q, k, v, start)
            if ext.PREFILL_BF16:  # (builds with AVX512-BF16: flash_bf16.h's unit)
                for products in ("bf16", "bf16-values"):
                    out[f"prefill {products} D{D} T{T} s{start}"] = ext.prefill_attention_cpu(
                        q, k, v, start, products
                    )
            if ext.PREFILL_INT16:  # (builds with AVX512-VNNI: flash_int16.h's unit)
                out[f"prefill int16 D{D} T{T} s{start}"] = ext.prefill_attention_cpu(
                    q, k, v, start, "int16"
                )


def save(path: str) -> None:
    ext = cpu_ext.load()
    assert ext is not None, cpu_ext.failure()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    _linears(ext, g, out)
    _attention(g, out)
    _small_ops(ext, g, out)
    torch.save({"isa": cpu_ext.isa(), "out": out}, path)
    print(f"{len(out)} outputs of the {cpu_ext.isa()} build -> {path}")


def compare(old: str, new: str) -> int:
    a, b = torch.load(old), torch.load(new)
    assert a["isa"] == b["isa"], (a["isa"], b["isa"])
    shared = [k for k in a["out"] if k in b["out"]]
    for k in sorted(a["out"].keys() ^ b["out"].keys()):  # (a kernel added or removed since)
        print(f"ONLY IN {'OLD' if k in a['out'] else 'NEW'}: {k}")
    differ = [k for k in shared if not torch.equal(a["out"][k], b["out"][k])]
    for k in differ:
        print(f"DIFFERS: {k}")
    print(f"{a['isa']}: {len(shared) - len(differ)} of {len(shared)} shared outputs bit-identical")
    return 1 if differ or len(shared) < len(a["out"]) else 0


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
