"""Library-side checks of user input: documents, sampling options, KV group size, cache home.

Each check raises QspecError (or ValueError for SamplingParams, which the CLI turns into one),
which the CLI prints as one `error:` line with exit code 2.
"""

import errno
import math
import os
import threading
from pathlib import Path

import pytest
from conftest import run_qspec

from kernels import MAX_DRAFTS
from qspec_core import atomic_write, documents, paths
from qspec_core.atomic_write import check_output_file
from qspec_core.config import check_gamma, check_kv_group_size, gamma_limit
from qspec_core.documents import read_document
from qspec_core.engine.sampling import MIN_TEMPERATURE, SamplingParams
from qspec_core.errors import QspecError
from qspec_core.paths import check_home, writable_models_dir

# ----------------------------------------------------------------------------- documents


@pytest.mark.parametrize("data", [b"\xef\xbb\xbf", b""], ids=["bom", "zero-bytes"])
def test_a_byte_order_mark_alone_is_an_empty_file(tmp_path, data):
    path = tmp_path / "doc.txt"
    path.write_bytes(data)
    with pytest.raises(QspecError, match="file is empty"):
        read_document(path)


@pytest.mark.parametrize(
    "data",
    [b"\xef\xbb\xbf \n\t\r\n", b"\xef\xbb\xbf\xef\xbb\xbf\n", b" \n"],
    ids=["bom-whitespace", "two-boms", "whitespace"],
)
def test_whitespace_alone_is_not_called_empty(tmp_path, data):
    path = tmp_path / "doc.txt"
    path.write_bytes(data)
    with pytest.raises(QspecError, match=f"{path}: holds only whitespace, no text$"):
        read_document(path)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_are_named_with_how_to_convert(tmp_path, encoding):
    path = tmp_path / "doc.txt"
    text = "The keeper counted 41 ships.\n"
    path.write_bytes(("\ufeff" + text if encoding == "utf-16-be" else text).encode(encoding))
    width = "32" if encoding == "utf-32" else "16"
    with pytest.raises(QspecError) as refused:
        read_document(path)
    message = str(refused.value)
    assert f"UTF-{width} text" in message and "binary" not in message
    assert f"iconv -f UTF-{width} -t UTF-8" in message


def test_bom_and_crlf_are_dropped_from_real_text(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert read_document(path) == "line one\nline two\n"


def test_a_pipe_handed_to_us_is_read_once():
    """/dev/stdin or <(cmd): an anonymous pipe, which came with its writer (a named FIFO
    need not have one, and is refused: tests/test_batch_hostile.py)."""
    read_end, write_end = os.pipe()

    def writer():
        with open(write_end, "w") as f:
            f.write("text through a pipe\n")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert read_document(f"/proc/self/fd/{read_end}") == "text through a pipe\n"
    finally:
        os.close(read_end)
    thread.join(timeout=10)


def test_standard_input_is_read_for_dash(monkeypatch, tmp_path):
    import io

    class Stdin:
        buffer = io.BytesIO("caf\u00e9 from a pipe".encode())

    monkeypatch.setattr(documents.sys, "stdin", Stdin())
    assert read_document("-") == "caf\u00e9 from a pipe"
    Stdin.buffer = io.BytesIO(b"\xef\xbb\xbf")
    with pytest.raises(QspecError, match=r"standard input \(-\): file is empty"):
        read_document("-")


def test_endless_or_huge_input_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    with pytest.raises(QspecError, match="is a device, not a regular file"):
        read_document("/dev/zero")  # refused before it is opened: no endless read
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 100_000)
    big = tmp_path / "big.txt"
    big.write_text("word " * 30_000)
    with pytest.raises(QspecError, match="larger than"):
        read_document(big)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("t", [1e-45, 1e-4, math.inf, -math.inf, math.nan, -1.0])
def test_temperature_must_be_zero_or_finite_and_not_tiny(t):
    with pytest.raises(ValueError, match="temperature must be 0 .greedy."):
        SamplingParams(temperature=t)


def test_smallest_temperature_samples_finite_probabilities():
    import torch

    from qspec_core.engine.sampling import probabilities

    logits = torch.tensor([[30.0, -30.0, 0.0]])
    p = probabilities(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert torch.isfinite(p).all() and p[0, 0] == 1.0


@pytest.mark.parametrize("top_p", [math.nan, 0.0, -0.5, 1.5, math.inf])
def test_top_p_must_be_in_unit_interval(top_p):
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=1.0, top_p=top_p)


# ----------------------------------------------------------------------------- KV group size


@pytest.mark.parametrize("g", [0, 1, 7, 63, -64, -2])
def test_group_size_must_be_even_and_at_least_two(g):
    with pytest.raises(QspecError, match="--group-size must be an even number >= 2"):
        check_kv_group_size(g)


@pytest.mark.parametrize(
    "group_size,head_dim,gamma,match",
    [
        (128, 64, None, "does not divide the model's head_dim 64"),
        (48, 64, None, "does not divide"),
        (16, None, 16, "--gamma 16 needs a KV group size above it"),
        (None, 16, 16, r"G = 16, the head_dim"),
        (2, None, 2, "use --gamma 1 or less"),
    ],
)
def test_group_size_against_head_dim_and_gamma(group_size, head_dim, gamma, match):
    with pytest.raises(QspecError, match=match):
        check_kv_group_size(group_size, head_dim, gamma)


@pytest.mark.parametrize(
    "group_size,head_dim,gamma",
    [
        (None, None, 4),
        (2, None, 1),
        (2, 64, None),
        (64, 64, 16),
        (None, 64, "auto"),
        (6, 96, 5),
        (2, 64, "auto"),  # auto starts below G (test_session: it runs)
    ],
)
def test_group_sizes_that_run(group_size, head_dim, gamma):
    check_kv_group_size(group_size, head_dim, gamma)


@pytest.mark.parametrize("gamma", [0, -1, MAX_DRAFTS + 1])
def test_gamma_must_be_in_one_to_max_drafts(gamma):
    with pytest.raises(QspecError, match=rf"--gamma must be in 1\.\.{MAX_DRAFTS}, not {gamma}"):
        check_gamma(gamma)


def test_gamma_limit_is_max_drafts_and_below_the_group():
    assert gamma_limit() == gamma_limit(MAX_DRAFTS + 1) == MAX_DRAFTS
    assert gamma_limit(8) == 7
    for gamma in (1, MAX_DRAFTS, "auto", None):
        check_gamma(gamma)
    check_gamma(7, 8)
    with pytest.raises(QspecError, match="use --gamma 7 or less"):
        check_gamma(8, 8)


# ----------------------------------------------------------------------------- cache home


@pytest.mark.parametrize("variable", ["QSPEC_HOME", "XDG_CACHE_HOME"])
def test_cache_home_on_a_regular_file_names_the_variable(tmp_path, variable):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(QspecError, match=f"{variable}={blocker}.*point QSPEC_HOME at a writable"):
        writable_models_dir({variable: str(blocker)})


def test_unwritable_cache_home(tmp_path, monkeypatch):
    # root may write anywhere, so the permission answer is simulated
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(QspecError, match=r"not writable\).*QSPEC_HOME="):
        writable_models_dir({"QSPEC_HOME": str(tmp_path / "home")})


def test_output_file_checks(tmp_path):
    check_output_file(tmp_path / "report.json", "--json")
    with pytest.raises(QspecError, match="is a folder"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(QspecError, match="does not exist"):
        check_output_file(tmp_path / "missing" / "report.json", "--json")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(QspecError, match=f"^--json: .*: {blocker} is a file, not a folder"):
        check_output_file(blocker / "report.json", "--json")


def _proc_refuses_new_files() -> bool:
    try:
        os.close(os.open("/proc/qspec-probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError:
        return os.path.isfile("/proc/version")
    os.unlink("/proc/qspec-probe")
    return False


@pytest.mark.skipif(not _proc_refuses_new_files(), reason="needs a Linux /proc")
def test_output_in_proc_says_what_failed():
    """/proc/version is a regular file in a folder root may "write" (os.access says so), yet
    no file can be created there, with ENOENT: the message gives that errno as it is, not a
    contradictory "/proc is not writable (No such file or directory)"."""
    for check in (
        lambda: check_output_file(Path("/proc/version"), "--json"),
        lambda: atomic_write.check_output(Path("/proc/version"), force=True),
        lambda: atomic_write.check_output(Path("/proc/version"), force=False),  # not "--force"
    ):
        with pytest.raises(QspecError) as refused:
            check()
        message = str(refused.value)
        assert "cannot write /proc/version: no new file can be made in /proc" in message
        assert "(No such file or directory)" in message and "not writable" not in message


def test_output_in_a_read_only_folder(read_only_tmp):
    """A refusal is "not writable", named with its errno, and comes before "exists": --force
    would not help. (Root writes any plain folder, so the refusal is simulated.)"""
    tmp_path = read_only_tmp
    existing = tmp_path / "report.json"
    existing.write_text("{}")
    with pytest.raises(QspecError, match=rf"--json: cannot write {existing}: {tmp_path} is not "):
        check_output_file(existing, "--json")
    with pytest.raises(QspecError, match=r"is not writable \(Read-only file system\)$"):
        atomic_write.check_output(existing, force=False)


def _bad_homes(tmp_path) -> dict[str, tuple[Path, str]]:
    """QSPEC_HOME values that cannot be used, and what the message must say of each."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    return {
        "file": (a_file, f"{a_file} is not a folder"),
        "inside-a-file": (a_file / "qspec", f"{a_file} is not a folder"),
        "dangling-link": (dangling, f"{dangling} is a symbolic link to {tmp_path / 'gone'}"),
        "below-a-dangling-link": (dangling / "qspec", f"{dangling} is a symbolic link"),
        "link-loop": (loop, f"{loop} is a symbolic link"),
    }


@pytest.mark.parametrize(
    "kind", ["file", "inside-a-file", "dangling-link", "below-a-dangling-link", "link-loop"]
)
def test_check_home_names_what_is_wrong(tmp_path, kind):
    home, words = _bad_homes(tmp_path)[kind]
    with pytest.raises(QspecError, match=f"QSPEC_HOME={home}: point QSPEC_HOME at a writable"):
        check_home({"QSPEC_HOME": str(home)})
    with pytest.raises(QspecError) as refused:
        check_home({"QSPEC_HOME": str(home)})
    assert words in str(refused.value)


def test_check_home_of_a_folder_that_refuses_files(tmp_path, monkeypatch):
    with pytest.raises(QspecError, match=r"home is not writable; it comes from QSPEC_HOME="):
        with monkeypatch.context() as patched:  # what a user without permission sees
            patched.setattr(os, "access", lambda path, mode: False)
            (tmp_path / "home").mkdir()
            check_home({"QSPEC_HOME": str(tmp_path / "home")})

    def read_only(*args, **kwargs):  # root passes os.access; a read-only mount still refuses
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(paths.tempfile, "mkdtemp", read_only)
    with pytest.raises(QspecError, match=r"is not writable \(Read-only file system\); it"):
        check_home({"QSPEC_HOME": str(tmp_path / "new")})


@pytest.mark.skipif(not _proc_refuses_new_files(), reason="needs a Linux /proc")
def test_check_home_in_proc():
    """os.access says yes to root in /proc; the trial create says what really happens."""
    with pytest.raises(QspecError, match=r"no folder can be made in /proc \(No such file"):
        check_home({"QSPEC_HOME": "/proc/qspec"})


def test_check_home_creates_nothing(tmp_path):
    check_home({"QSPEC_HOME": str(tmp_path / "home")})
    check_home({"XDG_CACHE_HOME": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "inside-a-file", "dangling-link"])
@pytest.mark.parametrize("command", ["prefill", "bench"])
def test_a_bad_home_is_the_one_error_line(tmp_path, kind, command):
    """In a fresh process, where the CPU kernels would build under QSPEC_HOME and warn that
    they cannot: the home is refused first, as the only line on stderr."""
    home, words = _bad_homes(tmp_path)[kind]
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted 41 ships.\n")
    env = {**os.environ, "QSPEC_HOME": str(home)}
    env.pop("QSPEC_CPU_KERNELS", None)  # (the kernels as a user has them)
    args = ["prefill", doc, "-o", tmp_path / "doc.qspec"] if command == "prefill" else [command]
    proc = run_qspec(*args, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot use "), proc.stderr
    assert words in lines[0]
    assert not (tmp_path / "doc.qspec").exists()
