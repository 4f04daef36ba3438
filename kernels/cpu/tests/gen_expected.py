"""Writes expected.txt, what the torch-free driver (driver.cpp) compares its cores against:

- `twin` records: the PyTorch twins' outputs (kernels/formats.py, kernels/cpu/linear.py, the
  eager RMSNorm and RoPE formulas) on the driver's inputs, redrawn here from the same LCG;
- `bits avx2` records: the x86 AVX2 build's own outputs (the driver compiled here with the AVX2
  flags of kernels/cpu/build.py), for the cores whose float sums the NEON paths order alike.

Run from the repository root on an x86-64 machine with AVX2 and a C++ compiler:
    python kernels/cpu/tests/gen_expected.py
"""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from kernels import MAX_STEP_ROWS  # noqa: E402
from kernels.cpu.build import compile_flags  # noqa: E402
from kernels.cpu.linear import int4_linear_ref, w8a8_linear_ref  # noqa: E402
from kernels.formats import round_symmetric  # noqa: E402
from kernels.reference import causal_attention  # noqa: E402

# Cases whose outputs the AVX2 and NEON builds share bit for bit (the rest: twins only). Not
# W4A8 ("int4_"): its vector lanes match, but its zero-point terms are scalar float code that
# the compiler contracts into fused multiply-adds as it sees fit per target (-ffp-contract=fast,
# C++'s default), and the results differed by a few ulp (int4_g64, and int4_m8 with -ffast-math).
BIT_EXACT_PREFIXES = ("round_", "w8a8_", "linear_", "attn_dots_")


class Lcg:
    """driver.cpp's `Lcg`: x <- 1664525 x + 1013904223 (mod 2^32)."""

    def __init__(self, seed: int):
        self.state = seed

    def next(self) -> int:
        self.state = (1664525 * self.state + 1013904223) % 2**32
        return self.state

    def below(self, n: int) -> int:
        return (self.next() >> 8) % n

    def ints(self, count: int, n: int, offset: int = 0) -> list[int]:
        return [self.below(n) + offset for _ in range(count)]

    def floats(self, count: int, lo: int, hi: int) -> torch.Tensor:
        return torch.tensor([(lo + self.below(hi - lo + 1)) / 256 for _ in range(count)])


def rounding(seed: int, n: int, kind: int, levels: int) -> torch.Tensor:
    x = Lcg(seed).floats(n, -2000, 2000)
    if kind == 1:
        x = x * torch.tensor(1e-33, dtype=torch.float32)
    if kind == 2:
        x[n // 3] = float("nan")
    codes, step = round_symmetric(x[None], chunk=n, levels=levels)
    # a NaN chunk: the C++ codes are 0 (isa.h: round_to_codes), the twin's NaN; + 0: no -0 codes
    return torch.cat((torch.nan_to_num(codes.flatten(), nan=0.0) + 0.0, step.flatten()))


def w8a8(seed: int, M: int, K: int, N: int, bias: bool) -> torch.Tensor:
    g = Lcg(seed)
    x = g.floats(M * K, -1024, 1024).view(M, K)
    w = torch.tensor(g.ints(N * K, 256, -128), dtype=torch.int8).view(N, K)
    scale, b = g.floats(N, 1, 64), g.floats(N, -256, 256)
    return w8a8_linear_ref(x, w, scale, b if bias else None)


def flash(seed: int, H: int, n_kv: int, T: int, start: int, D: int) -> torch.Tensor:
    """driver.cpp's `flash_case`: k/v rows with a head stride of (start + T + 3) rows."""
    g = Lcg(seed)
    S = start + T
    q = g.floats(H * T * D, -512, 512).view(1, H, T, D)
    k = g.floats(n_kv * (S + 3) * D, -512, 512).view(1, n_kv, S + 3, D)[:, :, :S]
    v = g.floats(n_kv * (S + 3) * D, -512, 512).view(1, n_kv, S + 3, D)[:, :, :S]
    return causal_attention(q, k, v, torch.arange(start, S)).flatten()


def int4(seed: int, M: int, K: int, N: int, G: int, bias: bool) -> torch.Tensor:
    g = Lcg(seed)
    x = g.floats(M * K, -1024, 1024).view(M, K)
    packed = torch.tensor(g.ints(N * K // 2, 256), dtype=torch.uint8).view(N, K // 2)
    scale = g.floats(N * (K // G), 1, 64).view(N, K // G)
    zero = g.floats(N * (K // G), 0, 15 * 256).view(N, K // G)
    b = g.floats(N, -256, 256)
    return int4_linear_ref(x, packed, scale, zero, G, b if bias else None)


def linear_f32(seed: int, M: int, K: int, N: int, bias: bool) -> torch.Tensor:
    g = Lcg(seed)
    x = g.floats(M * K, -512, 512).view(M, K)
    w = g.floats(N * K, -256, 256).view(N, K)
    b = g.floats(N, -256, 256)
    return F.linear(x.double(), w.double(), b.double() if bias else None).float()


def linear_i8(seed: int, M: int, K: int, N: int) -> torch.Tensor:
    g = Lcg(seed)
    x = g.floats(M * K, -512, 512).view(M, K)
    w = torch.tensor(g.ints(N * K, 256, -128), dtype=torch.float64).view(N, K)
    scale = g.floats(N, 1, 64)
    return (F.linear(x.double(), w) * scale.double()).float()


def rms_norm(seed: int, M: int, H: int) -> torch.Tensor:
    g = Lcg(seed)
    x = g.floats(M * H, -1024, 1024).view(M, H)
    w = g.floats(H, -512, 512)
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def rope(seed: int, T: int, D: int) -> torch.Tensor:
    g = Lcg(seed)
    x = g.floats(T * D, -1024, 1024).view(T, D)
    cos, sin = g.floats(T * D, -256, 256).view(T, D), g.floats(T * D, -256, 256).view(T, D)
    x1, x2 = x[:, : D // 2], x[:, D // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def attention_dots(seed: int, RT: int, n: int, D: int, target: bool) -> torch.Tensor:
    """attention_int.h's `int_dots_portable`, in int64: codes against the tokens' bytes u in the
    kernel's deinterleaved order (per segment of W dims: low nibbles, then high ones)."""
    g = Lcg(seed)
    up = np.array(g.ints(n * D // 2, 256), dtype=np.int64).reshape(n, D // 2)
    lo = np.array(g.ints(n * D // 2, 256), dtype=np.int64).reshape(n, D // 2)
    codes = np.array(g.ints(RT * D, 65535, -32767), dtype=np.int64).reshape(RT, D)
    W = 64 if D % 64 == 0 else D
    u = np.zeros((n, D), dtype=np.int64)
    for s in range(0, D, W):
        byte_u, byte_l = up[:, s // 2 : s // 2 + W // 2], lo[:, s // 2 : s // 2 + W // 2]
        even, odd = byte_u & 15, byte_u >> 4
        if target:
            even, odd = 16 * even + (byte_l & 15), 16 * odd + (byte_l >> 4)
        u[:, s : s + W // 2], u[:, s + W // 2 : s + W] = even, odd
    return torch.from_numpy((codes @ u.T).astype(np.float32))


def twins() -> dict[str, torch.Tensor]:
    """Every case of driver.cpp's `all_cases`, in its order, with the same arguments."""
    out = {
        "round_int8": rounding(1, 64, 0, 127),
        "round_int8_tiny": rounding(2, 64, 1, 127),
        "round_int8_nan": rounding(3, 64, 2, 127),
        "round_int16": rounding(4, 128, 0, 32767),
        "round_int16_d80": rounding(5, 80, 0, 32767),
    }
    for M in (1, 2, 3, 5, 8, 9, MAX_STEP_ROWS):
        out[f"w8a8_m{M}"] = w8a8(100 + M, M, 192, 13, M % 2 == 1)
        if M <= 8:
            out[f"int4_m{M}"] = int4(200 + M, M, 256, 11, 128, M % 2 == 0)
        out[f"linear_f32_m{M}"] = linear_f32(300 + M, M, 100, 9, M % 2 == 1)
        out[f"linear_i8_m{M}"] = linear_i8(400 + M, M, 136, 7)
    out["w8a8_gemm_m42"] = w8a8(142, 42, 192, 21, True)
    out["int4_g64"] = int4(250, 3, 192, 6, 64, True)
    out["flash_d64"] = flash(800, 6, 2, 45, 70, 64)
    out["flash_d80"] = flash(801, 2, 1, 33, 0, 80)
    out["rms_norm"] = rms_norm(500, 3, 576)
    out["rope"] = rope(600, 4, 64)
    out["attn_dots_draft"] = attention_dots(700, 3, 7, 64, False)
    out["attn_dots_target"] = attention_dots(701, 2, 5, 128, True)
    out["attn_dots_target_d80"] = attention_dots(702, 2, 3, 80, True)
    return out


def hex_floats(x: torch.Tensor) -> str:
    values = x.detach().float().flatten().tolist()
    return " ".join(struct.pack(">f", v).hex() for v in values)


def avx2_bits(compiler: str = "g++") -> list[str]:
    """The driver's `--dump` lines, built with the extension's avx2 flags."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "driver"
        flags = [f for f in compile_flags("avx2") if f != "-fopenmp"]
        cmd = [compiler, "-std=c++20", *flags, "-Wno-unknown-pragmas", "-o", str(exe)]
        subprocess.run([*cmd, str(HERE / "driver.cpp")], check=True)
        dump = subprocess.run([str(exe), "--dump"], check=True, capture_output=True, text=True)
    return [
        line for line in dump.stdout.splitlines() if line.split()[2].startswith(BIT_EXACT_PREFIXES)
    ]


def main() -> None:
    lines = [
        "# kernels/cpu/tests/expected.txt, written by gen_expected.py (do not edit): per case,",
        "# `twin NAME n fp32-bits...` (the PyTorch twins) and `bits avx2 NAME n fp32-bits...`",
        "# (the x86 AVX2 build's outputs, which the aarch64 NEON builds must reproduce).",
    ]
    lines += [f"twin {name} {x.numel()} {hex_floats(x)}" for name, x in twins().items()]
    lines += avx2_bits()
    (HERE / "expected.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
