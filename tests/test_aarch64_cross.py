"""The C++ CPU kernels on aarch64, checked on this x86 machine: every kernel source cross-compiled
with torch's headers, and the torch-free driver (kernels/cpu/tests/driver.cpp) run under
qemu-aarch64 user emulation against expected.txt (the PyTorch twins' outputs, and the x86 AVX2
build's bits that the NEON paths reproduce). The driver also runs natively, as a check of itself.
Needs Debian's cross tools: apt-get install -y g++-aarch64-linux-gnu qemu-user."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from kernels.cpu import build as cpu_ext

TESTS = Path(cpu_ext.HERE) / "tests"
DRIVER, EXPECTED = TESTS / "driver.cpp", TESTS / "expected.txt"
CROSS_CXX, QEMU, OBJDUMP = "aarch64-linux-gnu-g++", "qemu-aarch64", "aarch64-linux-gnu-objdump"
INSTALL = "apt-get install -y g++-aarch64-linux-gnu qemu-user"
# the extension's flags but the instruction set (-fopenmp only where torch's headers need it)
COMMON = [f for f in cpu_ext.compile_flags("generic") if not f.startswith("-march")]
DRIVER_FLAGS = ["-std=c++20", *[f for f in COMMON if f != "-fopenmp"], "-Wno-unknown-pragmas"]
# aarch64 builds: the sdot path (Armv8.2-A dotprod), plain NEON (Armv8.0-A), no SIMD at all
ARM_VARIANTS = {
    "dotprod": "-march=armv8.2-a+dotprod",
    "neon": "-march=armv8-a",
    "portable": "-march=armv8-a+nosimd",
}

needs_cross = pytest.mark.skipif(
    shutil.which(CROSS_CXX) is None or shutil.which(QEMU) is None,
    reason=f"no aarch64 cross compiler or qemu-aarch64 here (Debian: {INSTALL})",
)


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def summary(result: subprocess.CompletedProcess) -> tuple[int, int, int]:
    """(twin comparisons, bit-exact comparisons, failures) from the driver's last line."""
    pattern = r"(\d+) twin comparisons, (\d+) bit-exact comparisons, (\d+) failed"
    found = re.search(pattern, result.stdout)
    assert found, result.stdout + result.stderr
    return tuple(int(g) for g in found.groups())


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("aarch64")


# ----------------------------------------------------------------------------- natively


def native_driver(out_dir: Path, isa_flags: list[str], name: str) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    exe = out_dir / name
    built = run(["g++", *DRIVER_FLAGS, *isa_flags, "-o", str(exe), str(DRIVER)])
    assert built.returncode == 0, built.stderr
    return exe


def test_driver_matches_expected_natively(out_dir):
    """The driver itself, on this CPU: the portable paths (twins only) and, where this CPU has
    AVX2, the build whose bits expected.txt records."""
    generic = run([str(native_driver(out_dir, ["-march=x86-64"], "generic")), str(EXPECTED)])
    assert generic.returncode == 0, generic.stdout
    assert summary(generic)[0] > 30
    if not {"avx2", "fma", "f16c"} <= cpu_ext.cpu_flags():
        pytest.skip("no AVX2 here: the bit-exact records were not checked natively")
    avx2 = native_driver(out_dir, list(cpu_ext.ISA_FLAGS["avx2"]), "avx2")
    result = run([str(avx2), str(EXPECTED)])
    assert result.returncode == 0, result.stdout
    assert summary(result)[1] > 20


def test_driver_fails_on_a_wrong_expected_output(out_dir):
    """A flipped bit in one recorded output fails the check (the comparison has teeth)."""
    exe = native_driver(out_dir, ["-march=x86-64"], "generic")
    lines = EXPECTED.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("twin round_int8 "))
    fields = lines[at].split()
    fields[3] = f"{int(fields[3], 16) ^ 1:08x}"  # the first code, one ulp off
    lines[at] = " ".join(fields)
    wrong = out_dir / "wrong.txt"
    wrong.write_text("\n".join(lines) + "\n")
    result = run([str(exe), str(wrong)])
    assert result.returncode == 1 and "FAIL twin round_int8[0]" in result.stdout


# ----------------------------------------------------------------------------- aarch64


@needs_cross
@pytest.mark.parametrize("variant", ARM_VARIANTS)
def test_driver_matches_expected_under_qemu(out_dir, variant):
    """The cores on aarch64 against the twins; the NEON builds also against the AVX2 bits."""
    exe = out_dir / f"driver-{variant}"
    built = run(
        [CROSS_CXX, *DRIVER_FLAGS, ARM_VARIANTS[variant], "-static", "-o", str(exe), str(DRIVER)]
    )
    assert built.returncode == 0, built.stderr
    result = run([QEMU, str(exe), str(EXPECTED)])
    assert result.returncode == 0, result.stdout + result.stderr
    twins, exact, failed = summary(result)
    assert twins > 30 and failed == 0
    assert (exact > 20) == (variant != "portable"), result.stdout  # NEON: the AVX2 bits
    if shutil.which(OBJDUMP):  # the paths meant: sdot with dotprod only, no SIMD without NEON
        text = run([OBJDUMP, "-d", str(exe)]).stdout
        assert ("sdot\t" in text) == (variant == "dotprod")


@needs_cross
def test_every_kernel_source_compiles_for_aarch64():
    """Each source of the extension (torch's headers included) to an aarch64 object, as the
    extension's build would compile it on an Armv8.2-A CPU with dotprod. About two minutes of
    CPU, so the objects are kept under qspec's build folder, keyed by everything that goes in
    (sources, headers, flags, torch, the compiler), and a rerun on the same inputs reuses them."""
    includes = [f"-I{p}" for p in torch.utils.cpp_extension.include_paths()]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    flags = [
        "-std=c++20",
        *COMMON,
        ARM_VARIANTS["dotprod"],
        "-fPIC",
        "-w",
        "-DTORCH_EXTENSION_NAME=qspec_cpu_aarch64",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in cpu_ext.SOURCES + cpu_ext.HEADERS))
    digest.update(" ".join(flags + includes).encode() + torch.__version__.encode())
    digest.update(run([CROSS_CXX, "--version"]).stdout.encode())
    objects = cpu_ext.build_root() / f"aarch64_objects_{digest.hexdigest()[:12]}"
    objects.mkdir(parents=True, exist_ok=True)

    def compile_one(source: Path) -> tuple[Path, subprocess.CompletedProcess | None]:
        obj = objects / f"{source.stem}.o"
        if obj.exists():  # (written only by a compile that succeeded, below)
            return source, None
        partial = obj.with_suffix(f".{os.getpid()}.tmp")
        result = run([CROSS_CXX, *flags, *includes, "-c", str(source), "-o", str(partial)], 900)
        if result.returncode == 0:
            partial.replace(obj)
        return source, result

    workers = max(1, min(len(cpu_ext.SOURCES), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(compile_one, cpu_ext.SOURCES))
    failed = {s.name: r.stderr[-2000:] for s, r in results if r is not None and r.returncode}
    assert not failed, failed
    if shutil.which(OBJDUMP):  # the W8A8 / W4A8 cores took their sdot paths
        assert "sdot\t" in run([OBJDUMP, "-d", str(objects / "int_dot.o")]).stdout
