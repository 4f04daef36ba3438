"""The layout's rules, checked: no import cycles between modules, no oversized source files,
no Triton on a CPU run. (The layer contracts themselves are import-linter's, in
pyproject.toml, run by `make lint`.)"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("qspec_core", "qspec_cli", "kernels")
MAX_LINES = 600


def _imports_from_packages():
    """(importer, package) for each `from package import name` of ours: Python runs the
    package's __init__ to hand `name` over, an import grimp does not record where `name` is a
    submodule (runner/cpu.py's `from qspec_core.runner import kernel_table`, while
    runner/__init__.py imported cpu, was a cycle that it did not see)."""
    for path in sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != module:
                if (REPO / node.module.replace(".", "/") / "__init__.py").exists():
                    yield module, node.module


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    for importer, package in _imports_from_packages():
        graph.add_import(importer=importer, imported=package)
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported == module or imported.split(".")[0] not in PACKAGES:
                continue
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                cycles.append(" -> ".join((module,) + tuple(back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _sources() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.cpp", "*.h"], cwd=REPO, capture_output=True, text=True
    )
    if out.returncode:
        pytest.skip("not a git checkout")
    return [REPO / f for f in out.stdout.split()]


def test_no_source_file_is_longer_than_the_limit():
    long = {
        str(p.relative_to(REPO)): n
        for p in _sources()
        if p.exists() and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _layout_paths() -> set[str]:
    """The files the README's Layout section names, read from its indented tree."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    dirs: list[str] = []
    named = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        head = line.strip().split("  ")[0]
        names = [n.strip() for n in head.split(",")]
        if not all(n.endswith(("/", ".py", ".cpp", ".h", ".md")) for n in names):
            continue  # a description's continuation line
        if len(names) == 1 and names[0].endswith("/"):
            dirs[depth:] = [names[0]]
            continue
        for name in names:
            named.add("".join(dirs[:depth]) + name)
    return named


def test_readme_layout_names_every_source_file_and_only_real_ones():
    named = _layout_paths()
    ours = {
        str(p.relative_to(REPO))
        for p in _sources()
        if p.parts[len(REPO.parts)] in PACKAGES and p.name != "__init__.py"
    }
    assert ours - named == set(), "source files missing from the README's Layout"
    assert {n for n in named if not (REPO / n).exists()} == set(), "Layout names missing files"


# ---------------------------------------------------------------------------------------------
# Triton loads only where a kernel runs: a CPU run never imports it (72 MB resident)

_TRITON_LOADED = (
    "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'"
    " or m.startswith('kernels.triton.jit')))\n"
)


def _run_on_cpu(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh process as a CPU run sees it: no interpreter, no GPU."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_the_cli_and_the_runtime_import_no_triton():
    """What every command imports (`kernels.triton`'s host modules among them) loads no
    Triton: the kernels live in `kernels.triton.jit`, imported only when one runs."""
    run = _run_on_cpu(
        "import sys\nimport qspec_cli.app\nimport qspec_core.registry.runtime\n" + _TRITON_LOADED
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_a_cpu_session_imports_no_triton(tiny_model_dir):
    """A QuantSpec answer on CPU (the hierarchical cache's quantize-and-pack, the 4-bit draft,
    the INT8 target, the attention over the planes) chooses the twins or the C++ kernels
    without importing Triton."""
    run = _run_on_cpu(
        "import sys\n"
        "from qspec_core.engine.session import ChatSession\n"
        "from qspec_core.registry.runtime import load_runtime\n"
        f"runtime = load_runtime({str(tiny_model_dir)!r}, dtype='fp32', log=lambda m: None,"
        " need_draft=True)\n"
        "session = ChatSession(runtime, 'The quick brown fox. ' * 40, max_new_tokens=8)\n"
        "assert ''.join(session.ask('Summarize.'))\n" + _TRITON_LOADED
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"
