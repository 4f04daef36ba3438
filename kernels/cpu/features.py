"""What this CPU may run: the features cpuid advertises, narrowed to the state the OS grants.

cpuid (as /proc/cpuinfo lists it) says what the silicon, or a hypervisor's model of it, has.
AVX, AVX-512 and AMX also use registers that the OS must save on every context switch (the
XSAVE state components, enabled in XCR0): YMM upper halves for AVX (bits 1, 2), opmask and
ZMM for AVX-512 (bits 5, 6, 7), the tile config and data for AMX (bits 17, 18). An instruction
whose state the OS has not enabled dies of SIGILL whatever cpuid says, and Linux adds one more
gate for AMX: a process must ask for the tile data state with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` before its first AMX instruction.
The Xeon VMs this project ran on list amx_tile in /proc/cpuinfo and trap AMX instructions.

How the OS grant is learned, without running anything in qspec's process that could fault:

1. Linux >= 5.16 on x86-64: `arch_prctl(ARCH_GET_XCOMP_SUPP)` returns the XSAVE components
   the kernel manages for user space (XCR0 as it set it, plus the dynamically enabled AMX
   tile data). A syscall through ctypes: nothing of ours executes a new instruction.
2. Elsewhere (older kernels): XCR0 read by `xgetbv` in a ten-line C++ program compiled with
   the compiler that builds the kernels and run in a child process, so that a fault kills the
   child, not qspec. Without a compiler there is no kernel build to protect anyway: unknown,
   and cpuid is trusted.
3. AMX, only when asked for (`probe(ask_amx=True)`): the permission is requested in a child
   process, so qspec's own process is left as it was (qspec never runs AMX: the `native`
   build passes -mno-amx-*). Not asked: AMX counts as not granted.

A hypervisor can still trap what the OS believes it may run; nothing short of running the
instruction in a child tells, and qspec's kernels use no AMX at all. torch's own CPU kernels
(oneDNN) check for themselves: oneDNN's `amx::is_available` asks ARCH_REQ_XCOMP_PERM and its
xbyak reads XCR0 before using AVX-512 (oneDNN src/cpu/x64/cpu_isa_traits.cpp); where a
hypervisor grants AMX and still traps it, ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 keeps oneDNN off
AMX.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

X86 = platform.machine().lower() in ("x86_64", "amd64")
LINUX = sys.platform.startswith("linux")

# XSAVE state components (bit numbers of XCR0)
YMM = (1 << 1) | (1 << 2)  # SSE + AVX upper halves: every VEX-encoded instruction
ZMM = (1 << 5) | (1 << 6) | (1 << 7)  # opmask, ZMM_Hi256, Hi16_ZMM: AVX-512
TILES = (1 << 17) | (1 << 18)  # XTILECFG, XTILEDATA: AMX
APX = 1 << 19  # extended general-purpose registers
XTILEDATA = 18

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_REQ_XCOMP_PERM = 0x1023

# The child that reads XCR0 (fallback 2): cpuid's OSXSAVE first, as xgetbv faults without it
# (then the OS saves only x87 and SSE state: 0x3).
XGETBV_PROGRAM = r"""
#include <cpuid.h>
#include <cstdio>
int main() {
  unsigned a, b, c, d, lo, hi;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) { std::puts("0x3"); return 0; }
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  std::printf("%#llx\n", ((unsigned long long)hi << 32) | lo);
}
"""

# The child that asks for AMX (3): prints 1 if the kernel grants the tile data state.
AMX_REQUEST = (
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
    f"print(int(libc.syscall({SYS_ARCH_PRCTL}, {ARCH_REQ_XCOMP_PERM}, {XTILEDATA}) == 0))"
)


def state_needed(flag: str) -> int:
    """The XSAVE components an instruction set (a /proc/cpuinfo flag) needs; 0: none."""
    if flag.startswith("amx"):
        return TILES
    if flag.startswith(("avx512", "avx10")):
        return YMM | ZMM
    if flag.startswith("avx") or flag in ("fma", "f16c", "vaes", "vpclmulqdq"):
        return YMM
    if flag.startswith("apx"):
        return APX
    return 0


@dataclass(frozen=True)
class CpuFeatures:
    """cpuid's view and the OS's grant, side by side."""

    cpuid: frozenset[str]  # the flags /proc/cpuinfo lists
    os_xfeatures: int | None  # the XSAVE components the OS enables (XCR0); None: unknown
    source: str  # how os_xfeatures was learned
    amx_permitted: bool | None = None  # ARCH_REQ_XCOMP_PERM succeeded; None: not asked

    def granted(self, flag: str) -> bool:
        """cpuid lists `flag` and the OS saves the state its instructions use."""
        if flag not in self.cpuid:
            return False
        needed = state_needed(flag)
        if needed == TILES and self.amx_permitted is not True:
            return False
        return self.os_xfeatures is None or needed & self.os_xfeatures == needed

    @property
    def usable(self) -> frozenset[str]:
        """The flags whose instructions this process may run."""
        return frozenset(f for f in self.cpuid if self.granted(f))

    @property
    def withheld(self) -> frozenset[str]:
        """Listed by cpuid, not granted by the OS (or, for AMX, not asked for)."""
        return self.cpuid - self.usable

    def grants(self, state: int) -> bool:
        """The OS saves every component of `state` (unknown: assumed, as cpuid says)."""
        return self.os_xfeatures is None or state & self.os_xfeatures == state


def xcomp_supported() -> int | None:
    """ARCH_GET_XCOMP_SUPP: the XSAVE components Linux (>= 5.16) manages; None elsewhere."""
    if not (X86 and LINUX):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) != 0:
            return None  # EINVAL on kernels before 5.16
        return mask.value
    except (OSError, AttributeError):
        return None


def xcr0_from_child(compiler: str, timeout_s: float = 60.0) -> int | None:
    """XCR0 read by a compiled child process (fallback 2); None if it cannot be had."""
    if not X86:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="qspec-xcr0-") as tmp:
            source, program = Path(tmp) / "xcr0.cpp", Path(tmp) / "xcr0"
            source.write_text(XGETBV_PROGRAM)
            subprocess.run(
                [compiler, "-O0", "-o", str(program), str(source)],
                capture_output=True,
                check=True,
                timeout=timeout_s,
            )
            run = subprocess.run(
                [str(program)], capture_output=True, text=True, check=True, timeout=timeout_s
            )
            return int(run.stdout.strip(), 16)
    except (OSError, ValueError, subprocess.SubprocessError):  # (a signal: CalledProcessError)
        return None


def amx_permitted_in_child(timeout_s: float = 60.0) -> bool:
    """Would Linux grant this process the AMX tile data state? Asked in a child process."""
    if not (X86 and LINUX):
        return False
    try:
        run = subprocess.run(
            [sys.executable, "-c", AMX_REQUEST], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode == 0 and run.stdout.strip() == "1"


def parse_xfeatures(value: str) -> int:
    """An XSAVE component mask as written in a setting: 0xe7, 231 or 0b11100111."""
    mask = int(value.strip(), 0)
    if mask < 0:
        raise ValueError(value)
    return mask


def probe(
    cpuid: set[str] | frozenset[str],
    compiler: str | None = None,
    os_xfeatures: int | None = None,
    ask_amx: bool = False,
) -> CpuFeatures:
    """What this CPU may run. `os_xfeatures` given: taken as the OS's grant (tests force the
    'cpuid yes, OS no' case with it). `compiler` is the fallback's (none: no fallback)."""
    cpuid = frozenset(cpuid)
    if os_xfeatures is not None:
        source = "override"
    else:
        os_xfeatures, source = xcomp_supported(), "arch_prctl(ARCH_GET_XCOMP_SUPP)"
        if os_xfeatures is None and compiler and X86:
            os_xfeatures, source = xcr0_from_child(compiler), "xgetbv in a child process"
        if os_xfeatures is None:
            source = "unknown (cpuid trusted)"
    amx = None
    if ask_amx:
        wanted = "amx_tile" in cpuid and (os_xfeatures is None or TILES & os_xfeatures == TILES)
        # (an override decides alone: the test's 'OS no' must not ask the real OS)
        amx = wanted and (source == "override" or amx_permitted_in_child())
    return CpuFeatures(cpuid, os_xfeatures, source, amx)
