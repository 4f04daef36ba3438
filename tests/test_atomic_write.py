"""atomic_write: what the snapshot tests do not reach (they cover races, kill -9, devices)."""

import errno
import os
import stat

import pytest

from qspec_core import atomic_write
from qspec_core.atomic_write import remove_stale_temps, temp_path, write_atomic
from qspec_core.errors import QspecError


def test_a_published_file_has_the_usual_mode_and_exactly_the_bytes(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.bin", lambda f: f.write(b"abc"), force=False)
    finally:
        os.umask(old)
    out = tmp_path / "out.bin"
    assert out.read_bytes() == b"abc" and stat.S_IMODE(out.stat().st_mode) == 0o644
    assert out.stat().st_nlink == 1  # the temporary name is gone


def test_a_failing_writer_leaves_nothing_and_keeps_its_exception(tmp_path):
    def buggy(f):
        f.write(b"half")
        raise ValueError("a bug, not a user error")

    with pytest.raises(ValueError, match="a bug"):
        write_atomic(tmp_path / "out.bin", buggy, force=False)
    assert list(tmp_path.iterdir()) == []


def test_without_hard_links_a_failed_rename_gives_back_the_reservation(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    def failing_replace(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(atomic_write.os, "link", no_link)
    monkeypatch.setattr(atomic_write.os, "replace", failing_replace)
    with pytest.raises(QspecError, match="cannot write .*Input/output error"):
        write_atomic(tmp_path / "out.bin", lambda f: f.write(b"abc"), force=False)
    assert list(tmp_path.iterdir()) == []  # neither the temporary file nor the empty name


def test_temp_names_fit_a_long_output_name_and_odd_ones_are_left_alone(tmp_path):
    long = tmp_path / ("x" * 250)
    assert len(temp_path(long).name.encode()) <= 255
    host = atomic_write._host()
    odd = [
        f".s.{host}.0.0123abcd.tmp",  # pid 0 (kill(0) would signal our own group)
        f".s.{host}.99999999999.0123abcd.tmp",  # more digits than a pid has
        f".s.{host}.12x.0123abcd.tmp",
        f".s.{host}.123.0123ABCD.tmp",
    ]
    for name in odd:
        (tmp_path / name).write_bytes(b"")
    assert remove_stale_temps(tmp_path / "s") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(odd)
