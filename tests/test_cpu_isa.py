"""The CPU kernels' other instruction-set paths: the kernel tests again, built for each
`QSPEC_CPU_ISA` variant this machine runs that the default build does not already cover.

`generic` builds the portable C++ loops (`QSPEC_AVX2` undefined) that CPUs without AVX2 take;
`avx2` builds the AVX2/FMA intrinsics with 256-bit auto-vectorization, which is what AVX2
CPUs run, and differs from `native` only where the CPU has (and the OS grants) AVX-512 or
AVX-VNNI; `avxvnni` adds the integer-dot linears' 256-bit VNNI instructions (CPUs with AVX-VNNI
but no AVX-512 VNNI run those). Each variant is built once, when this test first runs, into
the user's qspec cache (1-2 minutes on 2 cores) and reused by later runs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import build as cpu_ext

REPO = Path(__file__).resolve().parent.parent
CPU_TESTS = [
    "tests/test_cpu_attention.py",
    "tests/test_cpu_linear.py",
    "tests/test_cpu_decode.py",
    "tests/test_cpu_step.py",
    "tests/test_batch_invariance.py",
    "tests/test_kernel_table.py",
    "tests/test_prefill_attention.py",
    "tests/test_products_choice.py",
    "tests/test_hier_cache.py::test_fused_attention_equals_the_reference_through_rounds_with_late_queries",
    # (its [False] case runs no C++ kernel)
    "tests/test_hier_cache.py::test_speculative_like_rounds_equal_a_replay_of_the_committed_tokens[None]",
]


def _skip_reason(isa: str) -> str | None:
    current = cpu_ext.requested_isa()
    if isa == current:
        return f"the default run covers {isa}"
    if isa in cpu_ext.ISA_NEEDS:
        flags = cpu_ext.cpu_features().usable  # (what the OS lets this process run)
        missing = [f for f in cpu_ext.ISA_NEEDS[isa] if f not in flags]
        if not cpu_ext._X86 or missing:
            return f"this CPU cannot run {isa} code (lacks {', '.join(missing) or 'x86-64'})"
        if isa == "avx2" and current == "native" and "avx512f" not in flags:
            if "avx_vnni" not in flags:
                return "without AVX-512 or AVX-VNNI, native builds the same AVX2 paths"
        if isa == "avxvnni" and current == "native" and "avx512_vnni" not in flags:
            return "without AVX-512 VNNI, native builds the same AVX-VNNI paths"
    return None


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "generic"])
def test_cpu_kernel_tests_pass_on_every_isa_variant(isa):
    reason = _skip_reason(isa)
    if reason:
        pytest.skip(reason)
    env = {**os.environ, cpu_ext.ISA_ENV: isa, "TRITON_INTERPRET": "1"}
    env.pop(cpu_ext.DISABLE_ENV, None)
    code = "from kernels.cpu import build; build.load(); print(build.isa(), build.failure())"
    built = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert built.returncode == 0 and built.stdout.split()[:1] == [isa], (
        f"the {isa} build failed: {built.stdout.strip()}\n{built.stderr[-3000:]}"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CPU_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"{cpu_ext.ISA_ENV}={isa}:\n{tail}"
    assert "C++ compiler" not in run.stdout, f"kernel tests skipped under {isa}:\n{tail}"


def test_no_stage_of_any_build_falls_off_a_cliff_against_torch():
    """`benchmarks/isa_matrix.py --quick --guard 0.5`: every stage of every build this CPU runs
    (prefill attention and linears, decode linears and attention) at least half as fast as
    torch's own path for the same numbers, timed side by side in one process. A ratio, not a
    timing: it catches a kernel written for one register width that another ISA runs at a tenth
    of its speed (the AVX2 prefill attention ran 15-30x slower than SDPA), not a few percent."""
    if not cpu_ext.available():
        pytest.skip(f"C++ kernels unavailable: {cpu_ext.failure()}")
    env = {k: v for k, v in os.environ.items() if k != cpu_ext.DISABLE_ENV}
    run = subprocess.run(
        [sys.executable, "benchmarks/isa_matrix.py", "--quick", "--guard", "0.5"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "| prefill attention, measured products |" in run.stdout, run.stdout
