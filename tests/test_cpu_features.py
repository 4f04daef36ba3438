"""CPUs that advertise what they cannot run (`kernels/cpu/features.py`, `build.py`).

cpuid may list AVX-512 or AMX that the OS does not enable (XCR0) or that a hypervisor traps:
running one of those instructions is a SIGILL. These tests force the "cpuid yes, OS no" case
with `QSPEC_CPU_OS_XFEATURES` and check that qspec then builds other flags (checked against
the compiler's own predefined macros), into another folder, and refuses the variants that need
the withheld state. None of them compiles the kernels.
"""

import shutil
import subprocess

import pytest

from kernels.cpu import build as cpu_ext
from kernels.cpu import features

AVX512_CPU = {"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni"}
AMX_CPU = AVX512_CPU | {"amx_tile", "amx_int8", "amx_bf16"}
X87_SSE_AVX = 0x7  # XCR0 of an OS that saves no AVX-512 state
ALL_STATE = 0x7 | features.ZMM | features.TILES


def _macros(flags: list[str]) -> set[str]:
    """The instruction-set macros the compiler defines under `flags`."""
    done = subprocess.run(
        [cpu_ext._cxx(), *flags, "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.split()[1] for line in done.stdout.splitlines()}
    return {m for m in names if m.startswith(("__AVX", "__AMX", "__FMA__", "__F16C__"))}


@pytest.fixture
def compiler():
    if not cpu_ext._X86 or shutil.which(cpu_ext._cxx()) is None:
        pytest.skip("needs an x86-64 C++ compiler")


def test_the_os_grant_narrows_what_cpuid_lists():
    have = features.probe(AMX_CPU, os_xfeatures=X87_SSE_AVX)
    assert have.source == "override"
    assert {"avx", "avx2", "fma", "f16c", "sse2"} <= have.usable
    assert not [f for f in have.usable if f.startswith(("avx512", "amx"))]
    assert {"avx512f", "amx_tile"} <= have.withheld
    # AMX needs its XCR0 bits and the per-process permission; not asked for: withheld
    assert "amx_tile" not in features.probe(AMX_CPU, os_xfeatures=ALL_STATE).usable
    granted = features.probe(AMX_CPU, os_xfeatures=ALL_STATE, ask_amx=True)
    assert granted.amx_permitted and {"amx_tile", "avx512f"} <= granted.usable
    no_tiles = features.probe(AMX_CPU, os_xfeatures=ALL_STATE & ~features.TILES, ask_amx=True)
    assert no_tiles.amx_permitted is False and "amx_tile" in no_tiles.withheld
    assert not features.probe(AMX_CPU, os_xfeatures=0x3).granted("avx2")  # no YMM: no AVX


def test_this_machine_is_probed_without_faulting():
    """Both ways of asking agree here (the fallback only runs on kernels before 5.16)."""
    if not (features.X86 and features.LINUX):
        pytest.skip("x86-64 Linux only")
    supported = features.xcomp_supported()
    if supported is None:
        pytest.skip("a kernel before 5.16: no ARCH_GET_XCOMP_SUPP")
    assert supported & 0x3 == 0x3  # x87 and SSE, always
    if shutil.which(cpu_ext._cxx()):
        xcr0 = features.xcr0_from_child(cpu_ext._cxx())
        # (the kernel's mask adds the AMX tile data that XCR0 enables on first use only)
        assert xcr0 is not None and xcr0 & ~features.TILES == supported & ~features.TILES
    have = cpu_ext.cpu_features()
    assert have.os_xfeatures == supported and have.source.startswith("arch_prctl")
    if "amx_tile" not in have.cpuid:
        assert cpu_ext.cpu_features(ask_amx=True).amx_permitted is False


def test_native_leaves_out_avx512_the_os_does_not_grant(monkeypatch, compiler):
    """-march=native alone reads cpuid: on a CPU listing AVX-512 the compiler would target it."""
    monkeypatch.delenv(cpu_ext.OS_XFEATURES_ENV, raising=False)
    granted_name = cpu_ext.build_name("native")
    zmm_granted = cpu_ext.cpu_features().grants(features.ZMM)
    monkeypatch.setenv(cpu_ext.OS_XFEATURES_ENV, hex(X87_SSE_AVX))
    flags = cpu_ext.compile_flags("native")
    assert "-mno-avx512f" in flags
    macros = _macros(flags)
    assert not [m for m in macros if "AVX512" in m or "AMX" in m], macros
    if {"avx2", "fma", "f16c"} <= cpu_ext.cpu_flags():
        assert {"__AVX2__", "__FMA__", "__F16C__"} <= macros  # (what the OS grants stays)
    # its own build folder where that is not what the OS grants (an AVX2-only CPU's OS saves
    # no AVX-512 state either: the same flags, the same folder)
    assert (cpu_ext.build_name("native") != granted_name) == zmm_granted
    monkeypatch.setenv(cpu_ext.OS_XFEATURES_ENV, "0x3")  # no AVX state at all
    assert not [m for m in _macros(cpu_ext.compile_flags("native")) if "AVX" in m]


def test_native_never_targets_amx(compiler):
    """On a CPU listing AMX (imitated with -march=sapphirerapids), granted or not."""
    for mask in (X87_SSE_AVX, ALL_STATE):
        have = features.probe(AMX_CPU, os_xfeatures=mask, ask_amx=True)
        flags = cpu_ext.compile_flags("native", have)
        assert set(cpu_ext.AMX_OFF) <= set(flags)
        spr = [f.replace("-march=native", "-march=sapphirerapids") for f in flags]
        assert not [m for m in _macros(spr) if "AMX" in m]
    assert "__AMX_TILE__" in _macros(["-march=sapphirerapids"])  # (what the flags take back)


@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_a_variant_whose_state_the_os_withholds_is_a_user_error(monkeypatch, isa):
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: AVX512_CPU | {"avx_vnni"})
    monkeypatch.setenv(cpu_ext.OS_XFEATURES_ENV, "0x3")
    with pytest.raises(cpu_ext.BuildSettingError, match="the OS does not enable"):
        cpu_ext._check_isa_runs_here(isa)
    monkeypatch.setenv(cpu_ext.OS_XFEATURES_ENV, hex(X87_SSE_AVX))
    cpu_ext._check_isa_runs_here(isa)  # (AVX state is enough for them)


def test_a_bad_override_is_a_user_error(monkeypatch):
    monkeypatch.setenv(cpu_ext.OS_XFEATURES_ENV, "avx2")
    with pytest.raises(cpu_ext.BuildSettingError, match="QSPEC_CPU_OS_XFEATURES='avx2'"):
        cpu_ext.cpu_features()
