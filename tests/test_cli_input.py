"""The CLI's error contract on odd input: exactly one `error:` line on stderr, exit code 2,
nothing written, no traceback; options checked before the model loads wherever they can be.

Most cases run `qspec_cli.app.main` in this process (fast); reading standard input and FIFOs
goes through a real `python -m qspec_cli.app` process.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from test_cli import run_qspec

from qspec_cli import app, common
from qspec_cli import prefill as prefill_command


@dataclass
class Result:
    code: int
    out: str
    err: str


def qspec(capsys, *args) -> Result:
    with pytest.raises(SystemExit) as exit_:
        app.main([str(a) for a in args])
    captured = capsys.readouterr()
    return Result(exit_.value.code, captured.out, captured.err)


def assert_one_error(result: Result, *words: str) -> None:
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The keeper counted 41 ships in the harbour.\n")
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(common, "load", load)


# ----------------------------------------------------------------------------- click's errors


@pytest.mark.parametrize(
    "args,words",
    [
        (["summarize", "{doc}", "--bogus"], ["No such option: --bogus", "qspec summarize --help"]),
        (["summarize", "{doc}", "--max-new-tokens", "abc"], ["'--max-new-tokens'"]),
        (["summarize", "{doc}", "--max-new-tokens", "0"], ["'--max-new-tokens'"]),
        (["summarize", "{doc}", "--threads", "0"], ["'--threads'"]),
        (["summarize", "{doc}", "--top-k", "-1"], ["'--top-k'"]),
        (["summarize", "{doc}", "--seed", str(2**64)], ["'--seed'"]),
        (["summarize", "{doc}", "--seed", "-1"], ["'--seed'"]),
        (["summarize"], ["Missing argument"]),
        (["chat", "--document"], ["--document"]),
        (["convert", "--group-size", "0"], ["'--group-size'"]),
        (["convert", "--calib-tokens", "5"], ["'--calib-tokens'"]),
        (["quality", "--max-tokens", "0"], ["'--max-tokens'"]),
        (["bench", "--repeats", "0"], ["'--repeats'"]),
        (["frobnicate"], ["No such command"]),
    ],
)
def test_option_errors_are_one_line(capsys, doc, no_model, args, words):
    assert_one_error(qspec(capsys, *[a.format(doc=doc) for a in args]), *words)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["summarize", "--help"]])
def test_help_and_version_still_exit_0(capsys, args):
    result = qspec(capsys, *args)
    assert result.code == 0 and result.out and not result.err


def test_bare_qspec_prints_the_help(capsys):
    result = qspec(capsys)
    assert result.code == 2 and "Usage" in result.out and not result.err  # click's convention


def test_ctrl_c_exits_130(capsys, doc, monkeypatch):
    def load(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "load", load)
    result = qspec(capsys, "summarize", doc)
    assert result.code == 130 and result.err.strip() == "interrupted"


def test_kernel_setting_errors_are_one_line(capsys, doc, monkeypatch):
    """The kernels' own user errors (a bad QSPEC_CPU_* setting) follow the same contract."""
    from kernels.cpu.build import BuildSettingError

    def load(*args, **kwargs):
        raise BuildSettingError("QSPEC_CPU_ISA='avx9': expected one of native, avx2")

    monkeypatch.setattr(common, "load", load)
    assert_one_error(qspec(capsys, "summarize", doc), "QSPEC_CPU_ISA='avx9'")


def test_a_bad_cpu_kernels_switch_is_refused_before_loading(capsys, doc, no_model, monkeypatch):
    """QSPEC_CPU_KERNELS takes 0 (off) or 1 (on, the default); anything else was taken as on."""
    from kernels.cpu import build

    monkeypatch.setenv("QSPEC_CPU_KERNELS", "bogus")
    assert_one_error(qspec(capsys, "summarize", doc), "QSPEC_CPU_KERNELS='bogus': expected 0 or 1")
    with pytest.raises(build.BuildSettingError):
        build.available()
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("QSPEC_CPU_KERNELS", value)
        assert build.kernels_enabled() is on


@pytest.mark.parametrize("command", ["summarize", "prefill", "bench"])
def test_a_bad_int8_prefill_setting_is_refused_before_loading(capsys, doc, monkeypatch, command):
    monkeypatch.setenv("QSPEC_INT8_PREFILL", "bf16")
    monkeypatch.setattr(common, "load", lambda *a, **k: pytest.fail("loaded"))
    args = (command,) if command == "bench" else (command, doc)
    assert_one_error(qspec(capsys, *args), "QSPEC_INT8_PREFILL='bf16'")


@pytest.mark.parametrize(
    "option,value",
    [
        ("--context", "2k,"),
        ("--context", "2k,,8k"),
        ("--context", ",2k"),
        ("--context", ","),
        ("--modes", "ar,"),
        ("--modes", "ar,,quantspec"),
        ("--modes", ""),
    ],
)
def test_bench_lists_refuse_an_empty_item(capsys, no_model, option, value):
    """`2k,,8k` is a typo, not a request for two sizes: refused, never silently dropped."""
    assert_one_error(qspec(capsys, "bench", option, value), option)


# ----------------------------------------------------------------------------- before the model


def _bad(option: str, *cases: tuple[str, str]) -> list[tuple[list[str], str]]:
    """(the options, the error's words) for each bad value of one option."""
    return [([option, value], message) for value, message in cases]


GROUP_AND_GAMMA = [
    *_bad("--group-size", ("7", "--group-size must be an even number >= 2"), ("63", "not 63"),
          ("1", "not 1"), ("0", "not 0"), ("-64", "not -64")),  # (0 used to mean the default)
    (["--group-size", "16", "--gamma", "16"], "--gamma 16 needs a KV group size above it"),
    *_bad("--gamma", ("0", "--gamma must be in 1..16"), ("17", "--gamma must be in 1..16"),
          ("many", "--gamma must be a number or 'auto'")),
]  # fmt: skip
SAMPLING = [
    *_bad("--temperature", ("1e-45", "temperature must be 0 (greedy) or a finite number >= 0.001"),
          ("inf", "not inf"), ("nan", "not nan"), ("-1", "not -1")),
    *_bad("--top-p", ("nan", "top_p must be in (0, 1], not nan"), ("0", "top_p"), ("1.5", "top_p")),
]  # fmt: skip
RUN = [
    (["--threads", "100000"], "--threads must be in 1.."),
    (["--dtype", "fp8"], "--dtype must be auto or one of"),
    (["--target-weights", "int4"], "--target-weights must be one of auto, full, int8, w8a8"),
]


@pytest.mark.parametrize("options,message", GROUP_AND_GAMMA + SAMPLING + RUN)
@pytest.mark.parametrize("command", ["summarize", "chat", "bench"])
def test_generation_options_are_checked_before_loading(
    capsys, doc, no_model, command, options, message
):
    args = {"summarize": [command, doc], "chat": [command, "--document", doc]}
    assert_one_error(qspec(capsys, *args.get(command, [command]), *options), message)


@pytest.mark.parametrize("options,message", GROUP_AND_GAMMA[:5] + RUN)
@pytest.mark.parametrize("command", ["prefill", "quality"])
def test_prefill_and_quality_options_are_checked_before_loading(
    capsys, doc, no_model, tmp_path, command, options, message
):
    if command == "quality" and "--target-weights" in options:
        pytest.skip("quality has no --target-weights")
    args = [command, doc] + (["-o", tmp_path / "s.qspec"] if command == "prefill" else [])
    assert_one_error(qspec(capsys, *args, *options), message)
    assert not (tmp_path / "s.qspec").exists()


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\xef\xbb\xbf", "file is empty"),
        (b"\xef\xbb\xbf  \n", "holds only whitespace"),
        (b"caf\xe9", "not UTF-8"),
        (b"\x00\x01", "looks binary"),
    ],
)
@pytest.mark.parametrize("command", ["summarize", "chat", "prefill", "quality"])
def test_bad_documents_before_loading(capsys, tmp_path, no_model, command, content, message):
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    args = [command, "--document", path] if command == "chat" else [command, path]
    assert_one_error(qspec(capsys, *args), f"{path}: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]


def test_other_inputs_before_loading(capsys, tmp_path, doc, no_model):
    folder = tmp_path / "folder.qspec"
    folder.mkdir()
    assert_one_error(qspec(capsys, "summarize", tmp_path), "is a folder")
    assert_one_error(qspec(capsys, "summarize", folder), str(folder))
    assert_one_error(qspec(capsys, "chat", folder), str(folder))
    assert_one_error(qspec(capsys, "chat", doc), "ends in .qspec")
    assert_one_error(qspec(capsys, "summarize", doc.with_suffix(".qspec")), "no such")
    assert_one_error(qspec(capsys, "convert", "--calib", tmp_path / "nope.txt"), "no such file")
    assert_one_error(qspec(capsys, "convert", "--method", "int3"), "--method 'int3'")
    assert_one_error(qspec(capsys, "convert", "--recipe", "int3"), "unknown recipe 'int3'")
    for clash in (["--method", "gptq"], ["--group-size", "64"], ["--draft-from", "x"]):
        assert_one_error(qspec(capsys, "convert", "--recipe", "gptq", *clash), "drop --method")
    for context in ("0", "abc", "-2k", ","):
        assert_one_error(qspec(capsys, "bench", "--context", context), "--context")
    assert_one_error(qspec(capsys, "bench", "--modes", "warp"), "--modes: unknown warp")
    assert_one_error(qspec(capsys, "bench", "--json", tmp_path / "no" / "r.json"), "not exist")
    assert_one_error(qspec(capsys, "bench", "--json", tmp_path), "is a folder")
    assert_one_error(qspec(capsys, "summarize", doc, "--mode", "warp"), "mode 'warp'")


def test_convert_refuses_an_odd_group_and_an_unwritable_output_before_work(capsys, no_model):
    """Issue 55's `--group-size 3` and `-o /proc/x`: refused before the model is read."""
    assert_one_error(qspec(capsys, "convert", "--group-size", "3"), "--group-size must be even")
    if os.path.isfile("/proc/version"):  # (a Linux /proc: no file can be made in it)
        result = qspec(capsys, "convert", "-o", "/proc/x")
        assert_one_error(result, "cannot write /proc/x: /proc is not writable")


def test_output_files_are_refused_with_the_true_reason(capsys, tmp_path, doc, no_model):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for output, words in [
        ("/", ["/ is a folder; give a file name"]),
        (tmp_path, [f"{tmp_path} is a folder"]),
        (blocker / "s.qspec", [f"{blocker} is a file, not a folder"]),
        (tmp_path / "s.qkv", [f"{tmp_path / 's.qkv'}: a snapshot's name ends in .qspec"]),
    ]:
        assert_one_error(qspec(capsys, "prefill", doc, "-o", output, "--force"), *words)
    if os.path.isfile("/proc/version"):  # a file no one can replace; ENOENT, not EACCES
        for args in (["prefill", doc, "-o", "/proc/version", "--force"],
                     ["bench", "--json", "/proc/version"]):  # fmt: skip
            result = qspec(capsys, *args)
            assert_one_error(result, "cannot write /proc/version: no new file can be made in /proc")
            assert "not writable" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "doc.txt"]


# ----------------------------------------------------------------------------- after the model


@pytest.fixture
def no_prefill(monkeypatch):
    """Fail the test if a command gets as far as building a session or running a bench."""
    import qspec_core.bench.quality
    import qspec_core.bench.runner

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the bad option was refused")

    monkeypatch.setattr(common, "ChatSession", refuse)  # summarize, chat
    monkeypatch.setattr(prefill_command, "ChatSession", refuse)
    monkeypatch.setattr(qspec_core.bench.runner, "run_bench", refuse)
    monkeypatch.setattr(qspec_core.bench.quality, "measure_kv_quality", refuse)


@pytest.mark.parametrize(
    "args,message",
    [
        (["summarize", "{doc}", "--group-size", "32"], "does not divide the model's head_dim 16"),
        (["summarize", "{doc}", "--group-size", "128", "--mode", "ar"], "does not divide"),
        (["summarize", "{doc}", "--gamma", "16"], "(G = 16, the head_dim)"),
        (["chat", "--document", "{doc}", "--group-size", "32"], "does not divide"),
        (["prefill", "{doc}", "-o", "{tmp}/s.qspec", "--group-size", "32"], "does not divide"),
        (["quality", "{doc}", "--group-size", "64"], "does not divide"),
        (["quality", "{doc}"], "no KV is quantized before 33 tokens"),
        (["bench", "--context", "300", "--group-size", "32"], "does not divide"),
        (["bench", "--context", "300", "--gamma", "16", "--modes", "quantspec"], "G = 16"),
    ],
)
def test_model_dependent_options_fail_before_any_prefill(
    capsys, tiny_model_dir, doc, tmp_path, no_prefill, args, message
):
    args = [a.format(doc=doc, tmp=tmp_path) for a in args]
    assert_one_error(qspec(capsys, *args, "--model", tiny_model_dir), message)
    assert not (tmp_path / "s.qspec").exists()


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("config.json", lambda c: [], "config.json: expected a JSON object, not list"),
        ("config.json", lambda c: {**c, "hidden_size": "576"}, "hidden_size must be an integer"),
        ("tokenizer_config.json", lambda c: [1, 2], "tokenizer_config.json: expected a JSON"),
    ],
)
def test_damaged_model_files_are_user_errors(
    capsys, tiny_model_dir, doc, tmp_path, name, edit, message
):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / name).write_text(json.dumps(edit(json.loads((model / name).read_text()))))
    assert_one_error(qspec(capsys, "summarize", doc, "--model", model), message)


# ----------------------------------------------------------------------------- markup in names


@pytest.mark.parametrize(
    "args,shown",
    [
        (["summarize", "x[/red].txt"], "x[/red].txt: no such file"),
        (["summarize", "report [final].txt"], "report [final].txt: no such file"),
        (["chat", "--document", "a[b]/x.txt"], "a[b]/x.txt: no such file"),
        (["info", "b[/x].qspec"], "b[/x].qspec"),
        (["summarize", "line\nbreak.txt"], "line break.txt: no such file"),  # one line
        (["summarize", "{doc}", "--model", "m[red]x"], "model 'm[red]x' not found"),
        (["summarize", "smile:smile:.txt"], "smile:smile:.txt"),  # no emoji either
        (["summarize", "back\\"], "back\\: no such file"),
    ],
)
def test_names_are_never_markup(capsys, doc, tmp_path, monkeypatch, args, shown):
    monkeypatch.chdir(tmp_path)
    assert_one_error(qspec(capsys, *[a.format(doc=doc) for a in args]), shown)


def test_markup_like_paths_in_a_whole_run(capsys, tiny_model_dir, doc, tmp_path, monkeypatch):
    """Snapshot, model folder and document named like rich markup: written, read and shown."""
    import shutil

    monkeypatch.setattr(common.out, "width", 400)  # long paths stay on one line

    model = tmp_path / "tiny[/x]"
    shutil.copytree(tiny_model_dir, model)
    snap = tmp_path / "snap" / "b[/x]" / "s[red].qspec"
    snap.parent.mkdir(parents=True)
    result = qspec(capsys, "prefill", doc, "-o", snap, "--model", model)
    assert result.code == 0, result.err
    assert f"wrote {snap}:" in " ".join(result.out.split()) and snap.is_file()
    result = qspec(capsys, "info", snap, "--model", model)
    assert result.code == 0, result.err
    assert "s[red].qspec" in result.out and "tiny[/x]" in result.out
    result = qspec(capsys, "summarize", snap, "--model", model, "--max-new-tokens", "2")
    assert result.code == 0, result.err
    assert "tiny[/x]" in result.out  # the table's title: model name, mode


# ----------------------------------------------------------------------------- chat /stats


def test_stats_counts_a_stopped_answer(capsys, tiny_model_dir, doc, monkeypatch):
    """/stats totals include a reply stopped by Ctrl-C; its title says so and counts it."""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("First?\nSecond?\n/stats\n/exit\n"))
    pieces = 0
    write = common.out.out

    def out(*args, **kwargs):
        nonlocal pieces
        pieces += 1
        if pieces == 1:  # the first piece of the first answer: Ctrl-C
            raise KeyboardInterrupt
        write(*args, **kwargs)

    monkeypatch.setattr(common.out, "out", out)
    args = ["chat", "--document", doc, "--model", tiny_model_dir, "--mode", "target-ar"]
    result = qspec(capsys, *args, "--max-new-tokens", "4")
    assert result.code == 0, result.err
    assert "(stopped)" in result.out
    assert "session · 2 answers (1 stopped)" in result.out


# ----------------------------------------------------------------------------- stdin and FIFOs


def run(*args, input=None, timeout=300):
    return run_qspec(*args, input=input, timeout=timeout)


QUICK = ["--mode", "target-ar", "--max-new-tokens", "2", "--json"]


@pytest.mark.parametrize("path", ["-", "/dev/stdin"])
def test_document_from_a_pipe_is_read_once(tiny_model_dir, path):
    proc = run("summarize", path, "--model", tiny_model_dir, *QUICK, input="Ships: 41.\n")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt_tokens"] > 10


def test_document_from_process_substitution_is_read_once(tiny_model_dir):
    """`qspec summarize <(cmd)`: a pipe handed over as /dev/fd/N works like `-` (a FIFO made
    with mkfifo is refused: tests/test_batch_hostile.py)."""
    script = f'exec {sys.executable} -m qspec_cli.app summarize <(echo "Ships: 41.") "$@"'
    args = ["--model", str(tiny_model_dir), *QUICK]
    proc = subprocess.run(
        ["bash", "-c", script, "bash", *args], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr


def test_prefill_and_chat_with_standard_input(tiny_model_dir, tmp_path):
    text = "The keeper counted 41 ships.\n"
    proc = run("prefill", "-", "--model", tiny_model_dir, input=text)
    assert proc.returncode == 2 and "needs -o/--output" in proc.stderr, proc.stderr
    snap = tmp_path / "piped.qspec"
    proc = run("prefill", "-", "-o", snap, "--model", tiny_model_dir, input=text)
    assert proc.returncode == 0 and snap.is_file(), proc.stderr
    proc = run("chat", "--document", "-", "--model", tiny_model_dir, input=text)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --document -:"), proc.stderr


def test_convert_lists_its_recipes(capsys, no_model):
    listed = qspec(capsys, "convert", "--recipes")
    assert listed.code in (0, None) and "gptq-mlp" in listed.out and "int8-upper" in listed.out
    as_json = qspec(capsys, "convert", "--recipes", "--json")
    assert json.loads(as_json.out)["gptq-head8"]["modules"] == "no-head"
