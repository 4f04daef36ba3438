"""Builds qspec's C++ CPU kernels once, as one extension module, into qspec's cache.

Sources: `hier_attention.cpp` (attention over the hierarchical cache), `kv_cache.cpp` (the
caches' C++ objects: the one writer of a step's K/V, and the attention), `flash_prefill.cpp`
(a prefill chunk's causal attention over the full-precision cache), `linear.cpp`
(x W^T for the few rows of a decode or verify step), `int_dot.cpp` (the same on int8
activations: the INT8 target's W8A8 and the draft's W4A8), `decode.cpp` (the small ops around
them: RMSNorm, RoPE, the int4 linear's casts), `step.cpp` (all decoder layers of a
decode step in one call) and `module.cpp` (the bindings; with `step.cpp`, the only files that
parse `torch/extension.h`, 27 s a file: the others take `ATen/ATen.h`, 7 s). The build runs
on first use with the system C++ compiler (about a minute and a quarter on 2 cores), per
source, per instruction set and, for `native`, per CPU; if it fails, `available()` is False
and every caller keeps its PyTorch path.

Instruction set (`QSPEC_CPU_ISA`, read at first use): `native` (default: `-march=native`,
everything this CPU has and the OS lets it run, AVX-512 included), `avx2` (`-mavx2 -mfma
-mf16c`: the sources' AVX2 intrinsics paths, other loops auto-vectorized at 256 bits),
`avxvnni` (the same with `-mavxvnni`: the integer-dot linears' 256-bit `vpdpbusd`, what CPUs
with AVX-VNNI but no AVX-512 run) or `generic` (`-march=x86-64`: the portable C++ paths that
CPUs without AVX2 take). Each variant has its own build folder, so they coexist; `isa()`
names the one loaded.

What the CPU has is what the OS grants, not what cpuid lists (`features.py`): AVX and AVX-512
use register state the OS must enable (XCR0), and a hypervisor may list AMX and trap it. So
`native` adds `-mno-avx512f` where the OS does not save the AVX-512 state (`-mno-avx` where it
does not save AVX's), and `-mno-amx-tile -mno-amx-int8 -mno-amx-bf16` where cpuid lists AMX
(the kernels use none: said to the compiler, so no header takes an AMX path); `avx2` and
`avxvnni` are user errors where the OS withholds their state. `QSPEC_CPU_OS_XFEATURES` (an
XCR0 mask such as 0x7: x87, SSE and AVX, no AVX-512) replaces what the OS grants, for tests of
the "cpuid yes, OS no" machines; the flags, hence the build folder, follow it.

Progress: a build that compiles says so on stderr at once (the variant, the sources, the
flags), then the time so far: redrawn every second on a terminal, a line every 30 s
otherwise, and a last line with the total. Loading a finished build says nothing.
ninja runs the sources in parallel (torch passes no -j unless MAX_JOBS is set: ninja's
default, the cores + 2).

Concurrent and interrupted builds: torch guards a build folder with a `lock` file that a
killed build leaves behind, after which every later build waits on it forever. So each build
also holds `qspec-build.lock` with flock (released by the kernel however the holder dies); a
torch `lock` found while holding it is stale and is removed. A process that finds another one
building waits at most `QSPEC_CPU_BUILD_WAIT` seconds (default 300), saying so, then runs the
PyTorch paths.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import platform
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import TextIO

import torch

from kernels import MAX_STEP_ROWS
from kernels.cpu import features

try:
    import fcntl
except ImportError:  # (Windows: no inter-process lock; torch's baton alone guards the build)
    fcntl = None

HERE = Path(__file__).parent
SOURCES = tuple(
    HERE / n
    for n in (
        "hier_attention.cpp",
        "kv_cache.cpp",
        "flash_prefill.cpp",
        "dequant.cpp",
        "linear.cpp",
        "int_dot.cpp",
        "decode.cpp",
        "step.cpp",
        "module.cpp",
    )
)
HEADERS = tuple(sorted(HERE.glob("*.h")))  # hashed with the sources, so an edit rebuilds
DISABLE_ENV = "QSPEC_CPU_KERNELS"  # "0" turns the C++ kernels off (the PyTorch paths run), "1" on
ISA_ENV = "QSPEC_CPU_ISA"  # native (default) | avx2 | avxvnni | generic
SANITIZE_ENV = "QSPEC_CPU_SANITIZE"  # address,undefined | thread: a checking build (make sanitize)
OS_XFEATURES_ENV = "QSPEC_CPU_OS_XFEATURES"  # tests: the XCR0 mask to take as the OS's grant
WAIT_ENV = "QSPEC_CPU_BUILD_WAIT"  # seconds to wait for another process's build
DEFAULT_WAIT_S = 300.0  # a build takes 1-3 minutes on 2 busy cores; a slower one, longer
LOCK_NAME = "qspec-build.lock"  # ours: flock, holds the holder's pid
TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder

_X86 = features.X86
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),  # (no AVX-512 whatever the CPU has)
    "avxvnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    # the compiler's baseline: SSE2 on x86-64, so `QSPEC_AVX2` stays undefined
    "generic": ("-march=x86-64",) if _X86 else (),
}
# /proc/cpuinfo flags an ISA's code needs, granted by the OS: else it dies of SIGILL, silently
ISA_NEEDS = {"avx2": ("avx2", "fma", "f16c"), "avxvnni": ("avx2", "fma", "f16c", "avx_vnni")}
# What `native` never uses, said to the compiler (gcc 12 keeps __AMX_INT8__ after -mno-amx-tile)
AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")

_module = None  # the module built for `_isa` (None: not loaded yet, or failed: `_failed`)
_failed: str | None = None
_isa: str | None = None
_variants: dict[str, tuple[object | None, str | None]] = {}  # isa -> (module, failure)
_load_lock = threading.Lock()


class BuildSettingError(ValueError):
    """A QSPEC_CPU_* setting the user can fix (the CLI prints it as one error line)."""


# a build that failed for want of room (a full disk, a spent quota): not a missing compiler to
# fall back from, but something the user must fix, reported as an OSError of the build folder
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(error: BaseException, folder: Path) -> OSError | None:
    """The OSError to raise if `error` (or what caused it, or the compiler's output it quotes)
    says the disk is full; else None."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return OSError(seen.errno, os.strerror(seen.errno), str(folder))
        for number in _DISK_FULL:
            if os.strerror(number) in str(seen):
                return OSError(number, os.strerror(number), str(folder))
        seen = seen.__cause__ or seen.__context__
    return None


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock for longer than we were willing to wait."""


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cxx() -> str:
    return os.environ.get("CXX", "c++")  # (torch.utils.cpp_extension.get_cxx_compiler's rule)


@lru_cache(maxsize=8)
def _probe_os(cpuid: frozenset[str], compiler: str, ask_amx: bool) -> features.CpuFeatures:
    return features.probe(cpuid, compiler=compiler, ask_amx=ask_amx)


def cpu_features(ask_amx: bool = False) -> features.CpuFeatures:
    """cpuid's flags (`cpu_flags()`) beside what the OS grants of them: QSPEC_CPU_OS_XFEATURES
    if set, else the OS's answer (asked once per process). `ask_amx`: request the AMX state
    in a child process (else AMX counts as withheld)."""
    value = os.environ.get(OS_XFEATURES_ENV, "")
    flags = frozenset(cpu_flags())
    if not value.strip():
        return _probe_os(flags, _cxx(), ask_amx)
    try:
        mask = features.parse_xfeatures(value)
    except ValueError:
        raise BuildSettingError(
            f"{OS_XFEATURES_ENV}={value!r}: expected an XCR0 bit mask such as 0x7 or 0xe7"
        ) from None
    return features.probe(flags, os_xfeatures=mask, ask_amx=ask_amx)


def requested_isa(value: str | None = None) -> str:
    """The ISA variant `value` (default: QSPEC_CPU_ISA) names; BuildSettingError if none."""
    value = os.environ.get(ISA_ENV, "") if value is None else value
    isa = value.strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise BuildSettingError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_FLAGS)}")
    return isa


def _check_isa_runs_here(isa: str) -> None:
    if isa in ISA_NEEDS and not _X86:
        raise BuildSettingError(f"{ISA_ENV}={isa} needs an x86-64 CPU, not {platform.machine()}")
    have = cpu_features()
    needs = ISA_NEEDS.get(isa, ())
    if not have.cpuid:  # (no cpuinfo to read: trust the user's choice)
        return
    lacks = [f for f in needs if f not in have.cpuid]
    if lacks:
        raise BuildSettingError(f"{ISA_ENV}={isa}: this CPU lacks {', '.join(lacks)}")
    withheld = [f for f in needs if not have.granted(f)]
    if withheld:
        raise BuildSettingError(
            f"{ISA_ENV}={isa}: the CPU lists {', '.join(withheld)} but the OS does not enable "
            f"the register state they use (XCR0 {have.os_xfeatures:#x}, from {have.source})"
        )


def sanitizers(value: str | None = None) -> list[str]:
    """The sanitizers QSPEC_CPU_SANITIZE names ("address,undefined" or "thread"; empty: none).
    A sanitized build is its own variant (its flags are in the tag); the process must preload
    the sanitizer's runtime (`make sanitize` does)."""
    value = os.environ.get(SANITIZE_ENV, "") if value is None else value
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in ("address", "undefined", "thread")]
    if unknown or ("thread" in names and len(names) > 1):
        raise BuildSettingError(
            f"{SANITIZE_ENV}={value!r}: expected address, undefined, address,undefined or thread"
        )
    return names


@lru_cache(maxsize=8)
def _known_to_compiler(compiler: str, flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags of `flags` that `compiler` accepts (all of them, tried at once, in the usual
    case); none if it cannot be run (then the build fails and says why)."""

    def accepts(*tried: str) -> bool:
        try:
            done = subprocess.run(
                [compiler, "-Werror", *tried, "-E", "-x", "c++", os.devnull],
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0

    if not flags or accepts(*flags):
        return flags
    return tuple(f for f in flags if accepts(f))


def native_exclusions(have: features.CpuFeatures | None = None) -> tuple[str, ...]:
    """What `native` takes back from -march=native (which reads cpuid alone): the instruction
    sets whose register state the OS does not enable, and AMX wherever cpuid lists it (the
    kernels use none). Only flags the compiler knows (AMX's need gcc 11 or clang 12; an older
    compiler emits no AMX anyway)."""
    if not _X86:
        return ()
    have = cpu_features() if have is None else have
    wanted = []
    if not have.grants(features.YMM):  # (VEX encodings included: vaes, vpclmulqdq)
        wanted += ["-mno-avx", "-mno-vaes", "-mno-vpclmulqdq"]  # (AVX2, FMA, F16C, AVX-512 go)
    elif not have.grants(features.ZMM):
        wanted += ["-mno-avx512f"]  # (every AVX-512 extension goes with it)
    if not have.grants(features.APX) and any(f.startswith("apx") for f in have.cpuid):
        wanted += ["-mno-apxf"]  # (gcc 14+ only: dropped where the compiler does not know it)
    if any(f.startswith("amx") for f in have.cpuid):  # (elsewhere -march=native has no AMX)
        wanted += AMX_OFF
    return _known_to_compiler(_cxx(), tuple(wanted))


def compile_flags(isa: str, have: features.CpuFeatures | None = None) -> list[str]:
    """The flags the `isa` variant is built with; `have` (default: `cpu_features()`) decides
    what `native` leaves out."""
    isa_flags = ISA_FLAGS[isa]
    if isa == "native":
        isa_flags = (*isa_flags, *native_exclusions(have))
    # -fopenmp: at::parallel_for's OpenMP backend lives in headers; without it, serial
    flags = ["-O3", *isa_flags, "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
    # the step's row limit, defined once in Python (kernels/__init__.py): as a flag, `_tag`
    # hashes it, so a new value rebuilds
    flags.append(f"-DQSPEC_MAX_STEP_ROWS={MAX_STEP_ROWS}")
    if names := sanitizers():
        # -O1 -g: readable reports; -fno-sanitize-recover: the first finding stops the process
        flags[0] = "-O1"
        flags += ["-g", "-fno-omit-frame-pointer", f"-fsanitize={','.join(names)}"]
        flags += ["-fno-sanitize-recover=all"]
    return flags


def _tag(isa: str) -> str:
    """Build per source, per flags, per checkout and, for `native`, per CPU: -march=native
    code must not run on another CPU (the other variants run on any CPU that has their ISA).
    What the OS grants shows in the flags (`native_exclusions`)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    digest.update(" ".join(compile_flags(isa)).encode() + torch.__version__.encode())
    # torch's build.ninja names the sources by path: two checkouts of the same sources sharing
    # a folder would each find it out of date and rebuild it, over and over
    digest.update(str(HERE.resolve()).encode())
    if isa == "native":
        digest.update(" ".join(sorted(cpu_flags())).encode() or platform.processor().encode())
    return digest.hexdigest()[:12]


def build_name(isa: str) -> str:
    return f"qspec_cpu_{isa}_{_tag(isa)}"


def build_folder(isa: str | None = None) -> Path:
    """Where the `isa` variant (default: the requested one) is built."""
    name = build_name(isa or requested_isa())
    return build_root() / name


def build_root(env: dict[str, str] | None = None) -> Path:
    """$QSPEC_HOME/build, else $XDG_CACHE_HOME/qspec/build, else ~/.cache/qspec/build: the
    rule of `qspec_core.paths.qspec_home` (a test holds the two together), read here because
    the kernels import nothing from qspec_core."""
    env = os.environ if env is None else env
    if env.get("QSPEC_HOME"):
        return Path(env["QSPEC_HOME"]).expanduser() / "build"
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "qspec" / "build"


def _warn(message: str) -> None:
    warnings.warn(f"qspec: {message}", stacklevel=3)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote, or '?' (it may not have written it yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "?"


@contextlib.contextmanager
def build_lock(
    folder: Path, wait_s: float, say: Callable[[str], None] = _warn, poll_s: float = 0.2
) -> Iterator[None]:
    """Holds the build folder's inter-process lock; inside, no other qspec process builds
    there. Waits up to `wait_s` for a holder, telling `say` once, then raises
    BuildLockTimeout. Removes a torch `lock` left by an interrupted build."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_flock(fd):
            # Loading a finished build holds the lock for a moment too (torch checks it is
            # up to date): say nothing for a short wait, then say who is holding it up.
            start = time.monotonic()
            deadline, quiet_until, said = start + wait_s, start + min(2.0, wait_s / 2), False
            while not _try_flock(fd):
                now = time.monotonic()
                left = deadline - now
                if not said and (now >= quiet_until or left <= 0):
                    said = True
                    say(
                        f"waiting for another qspec process to finish building the CPU "
                        f"kernels (pid {_holder(fd)}; at most {wait_s:g} s, then the PyTorch "
                        f"paths run)…"
                    )
                if left <= 0:
                    raise BuildLockTimeout(
                        f"another qspec process (pid {_holder(fd)}) was still building the CPU "
                        f"kernels after {wait_s:g} s ({folder})"
                    )
                time.sleep(min(poll_s, left))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        # Every qspec build holds our lock while torch's baton exists, so a baton seen now
        # was left by a build that died: torch would wait on it forever.
        baton = folder / TORCH_BATON
        if baton.exists():
            baton.unlink(missing_ok=True)
            say(f"removed the lock file of an interrupted CPU kernel build ({baton})")
        yield
    finally:
        os.close(fd)  # releases the flock


def _wait_s() -> float:
    value = os.environ.get(WAIT_ENV, "")
    if not value.strip():
        return DEFAULT_WAIT_S
    try:
        wait = float(value)
    except ValueError:
        wait = -1.0
    if not wait >= 0:
        raise BuildSettingError(f"{WAIT_ENV}={value!r}: expected a number of seconds >= 0")
    return wait


def _elapsed(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


@contextlib.contextmanager
def build_progress(
    what: str,
    detail: str = "",
    stream: TextIO | None = None,
    every_s: float | None = None,
    quiet_s: float = 0.0,
) -> Iterator[None]:
    """Says on `stream` (default: stderr) that `what` is compiling and for how long, while the
    body runs: after `quiet_s` (a body done sooner says nothing) a first line with `detail`,
    then the time so far every `every_s` (default: a line redrawn every second on a terminal,
    a new line every 30 s otherwise), and a last line with the total, or the time it failed
    after. From a thread: torch's `load` is silent and blocks."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    every_s = (1.0 if tty else 30.0) if every_s is None else every_s
    start = time.monotonic()
    done = threading.Event()
    shown = threading.Event()

    def say(text: str, last: bool = False) -> None:
        if tty:  # one line, redrawn: \r, then erase what a longer text left
            stream.write(f"\r{text}\033[K" + ("\n" if last else ""))
        else:
            stream.write(text + "\n")
        stream.flush()

    def tick() -> None:
        if done.wait(quiet_s):
            return
        shown.set()
        # a whole line (a long one wraps, and \r cannot redraw a wrapped line), then a short
        # one that a terminal redraws
        say(f"qspec: compiling {what}{detail} (the first time takes minutes)", last=True)
        while not done.wait(every_s):
            say(f"qspec: compiling {what}: {_elapsed(time.monotonic() - start)} so far")

    thread = threading.Thread(target=tick, name="qspec-build-progress", daemon=True)
    thread.start()
    ended = "failed after"
    try:
        yield
        ended = "compiled in"
    finally:
        done.set()
        thread.join()
        if shown.is_set():
            say(f"qspec: {what} {ended} {_elapsed(time.monotonic() - start)}", last=True)


def _compile(isa: str, name: str, folder: Path) -> object:
    """torch's build of the `isa` variant as module `name` in `folder`."""
    from torch.utils.cpp_extension import load

    return load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=compile_flags(isa),
        extra_ldflags=["-fopenmp", *(f for f in compile_flags(isa) if "sanit" in f)],
        build_directory=str(folder),  # (so TORCH_EXTENSIONS_DIR plays no part)
        verbose=False,
    )


def _build(
    isa: str,
    compile: Callable[[str, str, Path], object] = _compile,
    progress: TextIO | None = None,
) -> tuple[object | None, str | None]:
    """(module, None), or (None, why) with a warning. `compile` (tests: a fake) builds and
    loads; `progress` is where the build says how it goes (default: stderr)."""
    wait_s = _wait_s()
    folder = build_folder(isa)
    name = folder.name
    failed = None
    with contextlib.ExitStack() as held:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held.enter_context(build_lock(folder, wait_s))
        except OSError as e:  # QSPEC_HOME is a file, read-only, ...
            if (full := _disk_full(e, folder)) is not None:
                raise full from None
            failed = f"cannot use the build folder {folder}: {e.strerror or e}"
        except BuildLockTimeout as e:
            failed = str(e)
        else:
            # A finished build (its library there) loads in a second: quiet unless ninja
            # finds work to do (an object deleted, an interrupted build)
            quiet_s = 5.0 if (folder / f"{name}.so").exists() else 0.0
            what = f"the CPU kernels ({isa})"
            detail = (
                f": {', '.join(p.name for p in SOURCES)} with {' '.join(compile_flags(isa))}"
                f", into {folder}"
            )
            try:
                with build_progress(what, detail, stream=progress, quiet_s=quiet_s):
                    return compile(isa, name, folder), None
            except Exception as e:  # no compiler, no headers: the PyTorch paths still work
                if (full := _disk_full(e, folder)) is not None:
                    raise full from None  # (a full disk: the user's to fix, said in one line)
                failed = f"{type(e).__name__}: {e}".splitlines()[0]
    _warn(f"CPU kernels unavailable ({failed}); using the PyTorch paths")
    return None, failed


def load(isa: str | None = None):
    """The extension module, or None when it cannot be built here (warned once). Built for
    `isa`, by default the QSPEC_CPU_ISA of the first call (the variant this process runs);
    each variant is built and loaded once per process."""
    global _module, _failed, _isa
    if isa is None and (_module is not None or _failed is not None):
        return _module  # (the hot path: callers ask once per layer or linear)
    with _load_lock:
        chosen = requested_isa(isa)
        if chosen not in _variants:
            _check_isa_runs_here(chosen)
            _variants[chosen] = _build(chosen)
        if isa is None:
            _module, _failed = _variants[chosen]
            _isa = chosen
        return _variants[chosen][0]


def kernels_enabled() -> bool:
    """QSPEC_CPU_KERNELS: 0 turns the C++ kernels off, 1 (or unset) leaves them on;
    BuildSettingError for anything else (a typo must not silently mean "on")."""
    value = os.environ.get(DISABLE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise BuildSettingError(f"{DISABLE_ENV}={value!r}: expected 0 or 1 (0 turns them off)")
    return value != "0"


def available() -> bool:
    if not kernels_enabled():
        return False
    return load() is not None


def loaded():
    """The extension module where this process has loaded it already, else None: never
    builds (the caches ask it for their C++ side on every write; a runner loads the kernels)."""
    if not kernels_enabled():
        return None
    return _module


def failure() -> str | None:
    """Why the build failed, if it did."""
    return _failed


def isa() -> str | None:
    """The ISA variant of the loaded kernels (a key of ISA_FLAGS), None if none is
    loaded; `compile_flags(isa())` are the flags it was built with."""
    return _isa if _module is not None else None
