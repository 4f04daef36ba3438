"""The layout's rules, checked: no import cycles between modules, no oversized source files.
(The layer contracts themselves are import-linter's, in pyproject.toml, run by `make lint`.)"""

import subprocess
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("qspec_core", "qspec_cli", "kernels")
MAX_LINES = 600


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
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
