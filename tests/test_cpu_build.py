"""Building the CPU kernels (`kernels/cpu/build.py`): never a silent hang, never a crash.

The lock logic runs against real processes (a holder in a child process, killed with
SIGKILL); one end-to-end test kills a real build while torch's `lock` file exists and checks
the next build finishes. None of these compile the kernels from scratch: the end-to-end test
starts from a copy of the default build with one object file removed (a whole build only if
the sources changed since this session built them).
"""

import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels.cpu import build as cpu_ext
from qspec_core.errors import user_errors
from qspec_core.paths import qspec_home

REPO = Path(__file__).resolve().parent.parent

# A child that takes the build lock of a folder, says so, and sleeps until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from kernels.cpu import build as cpu_ext
with cpu_ext.build_lock(Path(sys.argv[1]), wait_s=0):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder():
    """start(folder): a child process holding the folder's build lock until the test ends."""
    children = []

    def start(folder: Path) -> subprocess.Popen:
        folder.mkdir(parents=True, exist_ok=True)
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        children.append(child)
        assert child.stdout.readline().strip() == "held"
        return child

    yield start
    for child in children:  # (only the children this test started)
        if child.poll() is None:
            child.kill()
        child.wait()


@pytest.fixture
def fresh(monkeypatch):
    """cpu_ext as in a new process (what it loaded is restored afterwards)."""
    for name, value in (("_variants", {}), ("_module", None), ("_failed", None), ("_isa", None)):
        monkeypatch.setattr(cpu_ext, name, value)
    monkeypatch.delenv(cpu_ext.DISABLE_ENV, raising=False)
    return monkeypatch


def test_a_stale_torch_lock_is_removed_once_we_hold_the_lock(tmp_path):
    (tmp_path / cpu_ext.TORCH_BATON).write_text("")  # as a killed build leaves it
    said = []
    with cpu_ext.build_lock(tmp_path, wait_s=0, say=said.append):
        assert not (tmp_path / cpu_ext.TORCH_BATON).exists()
        assert (tmp_path / cpu_ext.LOCK_NAME).read_text().strip() == str(os.getpid())
    assert len(said) == 1 and "interrupted" in said[0]
    with cpu_ext.build_lock(tmp_path, wait_s=0, say=said.append):
        pass  # released on exit, and nothing more to say
    assert len(said) == 1


def test_a_live_holder_is_waited_for_with_its_pid_then_given_up_on(tmp_path, holder):
    child = holder(tmp_path)
    (tmp_path / cpu_ext.TORCH_BATON).write_text("")  # the live build's own: not stale
    said = []
    t0 = time.monotonic()
    with pytest.raises(cpu_ext.BuildLockTimeout, match=f"pid {child.pid}"):
        with cpu_ext.build_lock(tmp_path, wait_s=0.5, say=said.append, poll_s=0.05):
            pytest.fail("entered while another process holds the lock")
    assert 0.5 <= time.monotonic() - t0 < 5
    assert len(said) == 1
    assert said[0].startswith(
        f"waiting for another qspec process to finish building the CPU kernels (pid {child.pid}"
    )
    assert (tmp_path / cpu_ext.TORCH_BATON).exists()


def test_a_holder_killed_with_sigkill_releases_the_lock(tmp_path, holder):
    child = holder(tmp_path)
    (tmp_path / cpu_ext.TORCH_BATON).write_text("")
    child.send_signal(signal.SIGKILL)
    child.wait()
    said = []
    t0 = time.monotonic()
    with cpu_ext.build_lock(tmp_path, wait_s=30, say=said.append, poll_s=0.05):
        assert not (tmp_path / cpu_ext.TORCH_BATON).exists()  # its baton: stale now
    assert time.monotonic() - t0 < 5
    assert [s for s in said if "interrupted" in s] and not [s for s in said if "waiting" in s]


def test_load_gives_up_on_a_busy_build_folder_and_falls_back(tmp_path, holder, fresh):
    fresh.setenv("QSPEC_HOME", str(tmp_path / "home"))
    fresh.setenv(cpu_ext.WAIT_ENV, "0.5")
    child = holder(cpu_ext.build_folder())
    t0 = time.monotonic()
    with pytest.warns(UserWarning) as caught:
        assert cpu_ext.load() is None
    assert time.monotonic() - t0 < 10
    said = "\n".join(str(w.message) for w in caught)
    assert (
        f"waiting for another qspec process to finish building the CPU kernels (pid {child.pid}"
        in said
    )
    assert "unavailable" in said and "PyTorch paths" in said
    assert not cpu_ext.available() and cpu_ext.isa() is None
    assert "still building" in cpu_ext.failure()
    assert cpu_ext.load() is None  # decided once: no second wait


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_load_falls_back_when_the_build_folder_cannot_be_made(tmp_path, fresh, kind):
    home = tmp_path / "home"
    if kind == "file":
        home.write_text("not a folder")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        home.mkdir(mode=0o500)
    fresh.setenv("QSPEC_HOME", str(home))
    with pytest.warns(UserWarning, match="cannot use the build folder"):
        assert cpu_ext.load() is None
    assert not cpu_ext.available()


def test_bad_settings_are_user_errors(fresh):
    fresh.setenv(cpu_ext.ISA_ENV, "avx512")
    with pytest.raises(
        cpu_ext.BuildSettingError, match="QSPEC_CPU_ISA='avx512': expected one of native"
    ):
        cpu_ext.load()
    fresh.setenv(cpu_ext.ISA_ENV, "generic")
    fresh.setenv(cpu_ext.WAIT_ENV, "soon")
    with pytest.raises(cpu_ext.BuildSettingError, match="QSPEC_CPU_BUILD_WAIT='soon'"):
        cpu_ext.load()


def test_build_settings_errors_are_reported_as_user_errors():
    """The CLI prints `user_errors()` as one line; the kernels raise their own class."""
    assert cpu_ext.BuildSettingError in user_errors()


@pytest.mark.parametrize(
    "env",
    [
        {"QSPEC_HOME": "/q/home"},
        {"QSPEC_HOME": "~/qh", "XDG_CACHE_HOME": "/xdg"},
        {"XDG_CACHE_HOME": "/xdg"},
        {"QSPEC_HOME": "", "XDG_CACHE_HOME": "~/x"},
        {},
    ],
)
def test_build_root_follows_qspec_home(env):
    """The kernels read the home folder themselves (they import nothing from qspec_core): the
    same rule as `qspec_core.paths.qspec_home`, or builds land where the CLI does not look."""
    assert cpu_ext.build_root(env) == qspec_home(env) / "build"


def test_avx2_on_a_cpu_without_it_is_a_user_error(fresh):
    fresh.setattr(cpu_ext, "cpu_flags", lambda: {"sse2", "avx"})
    fresh.setenv(cpu_ext.ISA_ENV, "avx2")
    with pytest.raises(cpu_ext.BuildSettingError, match="lacks avx2, fma, f16c"):
        cpu_ext.load()


def test_avxvnni_on_a_cpu_without_it_is_a_user_error(fresh):
    fresh.setattr(cpu_ext, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512_vnni"})
    fresh.setenv(cpu_ext.ISA_ENV, "avxvnni")
    with pytest.raises(cpu_ext.BuildSettingError, match="lacks avx_vnni"):
        cpu_ext.load()


def test_variants_get_their_own_flags_and_build_folders():
    names = {isa: cpu_ext.build_name(isa) for isa in cpu_ext.ISA_FLAGS}
    assert set(names) == {"native", "avx2", "avxvnni", "generic"}
    assert len(set(names.values())) == 4 and all(isa in n for isa, n in names.items())
    assert "-march=native" in cpu_ext.compile_flags("native")
    assert {"-mavx2", "-mfma"} <= set(cpu_ext.compile_flags("avx2"))
    assert not [f for f in cpu_ext.compile_flags("avx2") if "avx512" in f or "march" in f]
    assert "-mavxvnni" not in cpu_ext.compile_flags("avx2")
    vnni = set(cpu_ext.compile_flags("avxvnni"))
    assert vnni - set(cpu_ext.compile_flags("avx2")) == {"-mavxvnni"}
    assert "avx_vnni" in cpu_ext.ISA_NEEDS["avxvnni"]
    assert not [f for f in cpu_ext.compile_flags("generic") if "avx" in f or "native" in f]


def _run_load(env, timeout):
    code = (
        "from kernels.cpu import build as cpu_ext; "
        "print('isa', cpu_ext.isa() if cpu_ext.available() else None)"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,  # the bug this guards against was a hang
    )


def test_a_build_killed_while_torch_holds_its_lock_does_not_hang_the_next(tmp_path):
    """The original repro: kill a build (and its compiler) while `build/*/lock` exists; the
    next load used to wait forever in torch's FileBaton.wait."""
    if not cpu_ext.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    home = tmp_path / "home"
    built = Path(cpu_ext.load().__file__).parent
    folder = home / "build" / cpu_ext.build_folder().name  # where the children build
    if built.name == folder.name:  # (else the sources changed since: a whole build)
        shutil.copytree(built, folder)  # (copy2 keeps the times: ninja sees it up to date)
        (folder / "module.o").unlink()  # so the killed build has one file to compile
    env = {**os.environ, "QSPEC_HOME": str(home)}
    env.pop(cpu_ext.DISABLE_ENV, None)
    code = "from kernels.cpu import build as cpu_ext; cpu_ext.load()"
    builder = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (folder / cpu_ext.TORCH_BATON).exists():
            assert builder.poll() is None, "the build ended before it could be interrupted"
            assert time.monotonic() < deadline, "the build never took torch's lock"
            time.sleep(0.02)
    finally:  # the whole session: python, ninja and the compiler, as kill -9 of a job
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait()
    assert (folder / cpu_ext.TORCH_BATON).exists()  # left behind: the state that hung
    done = _run_load(env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["isa", cpu_ext.isa()], done.stderr[-3000:]
    assert "interrupted" in done.stderr
    assert not (folder / cpu_ext.TORCH_BATON).exists()


class FakeTty(io.StringIO):
    def isatty(self):
        return True


def test_progress_says_what_compiles_then_the_time_then_the_total():
    out = io.StringIO()  # (not a terminal: whole lines)
    with cpu_ext.build_progress("the CPU kernels (avx2)", ": a.cpp, b.cpp", out, every_s=0.05):
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("qspec: compiling the CPU kernels (avx2): a.cpp, b.cpp")
    assert len([line for line in lines if line.endswith("so far")]) >= 3, lines
    assert lines[-1] == "qspec: the CPU kernels (avx2) compiled in 0 s"
    assert not [line for line in lines if line.startswith("error")]


def test_progress_on_a_terminal_redraws_one_line():
    out = FakeTty()
    with cpu_ext.build_progress("the CPU kernels", "", out, every_s=0.05):
        time.sleep(0.3)
    text = out.getvalue()
    first, redrawn, end = text.split("\n")
    assert first.startswith("\rqspec: compiling the CPU kernels") and end == ""
    assert redrawn.count("\r") >= 4 and redrawn.endswith("compiled in 0 s\033[K")


def test_progress_is_quiet_for_a_quick_load_and_says_when_it_failed():
    out = io.StringIO()
    with cpu_ext.build_progress("the CPU kernels", "", out, every_s=0.05, quiet_s=5):
        pass  # (a finished build, loaded)
    assert out.getvalue() == ""
    with pytest.raises(RuntimeError, match="no compiler"):
        with cpu_ext.build_progress("the CPU kernels", "", out, every_s=0.05):
            raise RuntimeError("no compiler")
    assert out.getvalue().splitlines()[-1] == "qspec: the CPU kernels failed after 0 s"


@pytest.mark.parametrize("minutes", [0, 2])
def test_elapsed_times_read_as_minutes_and_seconds(minutes):
    assert cpu_ext._elapsed(minutes * 60 + 5.7) == (f"{minutes} min 05 s" if minutes else "5 s")


def test_a_build_shows_its_progress_on_stderr_only(tmp_path, fresh, capsys):
    """The CLI's stdout (`--json`) stays clean; the sources and the variant are named."""
    fresh.setenv("QSPEC_HOME", str(tmp_path))
    built = []

    def slow_compile(isa, name, folder):  # (a real build takes minutes)
        time.sleep(0.3)
        built.append(name)
        (folder / f"{name}.so").write_text("")
        return "module"

    assert cpu_ext._build("generic", compile=slow_compile) == ("module", None)
    out, err = capsys.readouterr()
    assert out == ""
    first, *_, last = err.splitlines()
    assert first.startswith("qspec: compiling the CPU kernels (generic): hier_attention.cpp")
    assert "module.cpp with -O3" in first and str(cpu_ext.build_folder("generic")) in first
    assert last.startswith("qspec: the CPU kernels (generic) compiled in ")
    # built already (its library there): loading says nothing
    assert cpu_ext._build("generic", compile=slow_compile) == ("module", None)
    assert capsys.readouterr() == ("", "") and len(built) == 2
