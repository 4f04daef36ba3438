"""The README's and PERF.md's figures table is the committed benchmark JSON's, and the plot is
written: benchmarks/readme_figures.py. A number typed into either table fails here."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import readme_figures  # noqa: E402

REPO = readme_figures.REPO


@pytest.mark.parametrize("name", readme_figures.TARGETS)
def test_the_marked_table_is_what_the_json_gives(name):
    text = (REPO / name).read_text()
    assert readme_figures.BEGIN in text and readme_figures.END in text
    expected = readme_figures.table(readme_figures.figures())
    assert readme_figures.marked_block(text) == expected, (
        f"{name}'s figures table differs from the JSON: run python benchmarks/readme_figures.py"
    )


def test_check_catches_a_typed_number(tmp_path, monkeypatch):
    """--check passes on a copy of the committed files and fails once one figure is edited."""
    for name in readme_figures.TARGETS + tuple(s.path for s in readme_figures.SOURCES):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    monkeypatch.setattr(readme_figures, "REPO", tmp_path)
    assert readme_figures.main(["--check"]) == 0
    readme = tmp_path / "README.md"
    block = readme_figures.marked_block(readme.read_text())
    first = next(f for f in readme_figures.figures())
    shown = f"{first.prefill[0]:,.0f} / "
    assert shown in block
    readme.write_text(readme.read_text().replace(shown, f"{first.prefill[0] + 100:,.0f} / ", 1))
    assert readme_figures.main(["--check"]) == 1


def test_every_series_has_llama_cpp_beside_qspec():
    figs = readme_figures.figures()
    assert {f.cpu_class for f in figs} == {"AVX2", "AVX-512"}
    for f in figs:
        assert min(f.prefill + f.decode + f.total) > 0
        assert f.mode in readme_figures.QSPEC_MODES


def test_the_plot_is_a_png_without_a_version_stamp(tmp_path):
    path = tmp_path / "time-to-summary.png"
    readme_figures.plot(readme_figures.figures(), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (800, 500)
    assert b"Software" not in data and b"atplotlib" not in data


def test_each_sources_commit_is_the_one_that_added_its_json():
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)

    shallow = git("rev-parse", "--is-shallow-repository")
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("not a full git checkout")
    for source in readme_figures.SOURCES:
        added = git("log", "--diff-filter=A", "--format=%h", "--", source.path).stdout.split()
        assert added and added[-1].startswith(source.commit), source.path
