"""Property tests: whatever happens to a snapshot's bytes, the readers answer QspecError.

One real snapshot (a small random cache, written by save_snapshot) is made per module; each
example mutates a copy: truncation, a flipped bit in the header length, the JSON header or
the data, a resized or retyped tensor in the header (the file grown sparsely so that it is
valid safetensors), manifest edits with a recomputed checksum, garbage. For each mutation
read_manifest, verify_snapshot and load_snapshot must refuse with QspecError (read_manifest
may accept what only the data checksums can see), and never raise anything else, hang
(SIGALRM), or read into memory more bytes than the file holds (a spy on the one function
through which every snapshot byte is read sums the buffers the bytes land in: tensors are
allocated at exactly their size, plus one reused chunk for streamed checksums).
"""

import contextlib
import json
import os
import signal
import struct
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_snapshot import (
    _rewrite_header,
    _rewrite_manifest,
    fake_model_folder,
    load_small,
    save_small,
)

from qspec_core.errors import QspecError
from qspec_core.store import schema
from qspec_core.store import snapshot as snap

FUZZ = settings(max_examples=100, deadline=None, database=None)  # no .hypothesis/ in the tree
READERS = ("read_manifest", "verify_snapshot", "load_snapshot")


class Original(SimpleNamespace):
    def __repr__(self):  # hypothesis prints the fixture in a failure report: keep it short
        return f"<snapshot of {len(self.data)} bytes>"


class Hung(BaseException):
    """Not an Exception: no reader's `except` may swallow it."""


@contextlib.contextmanager
def time_limit(seconds: int):
    def alarm(signum, frame):
        raise Hung(f"a reader ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    model = fake_model_folder(folder / "model")
    save_small(folder / "original.qspec", model)
    data = (folder / "original.qspec").read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    return Original(data=data, header_end=header_end, model=model, path=folder / "m.qspec")


def run_readers(s) -> dict[str, tuple[str, int]]:
    """reader -> ("ok" | "refused", bytes it read); any other exception fails the test."""
    size = s.path.stat().st_size
    results = {}
    for name in READERS:
        read, buffers = [], {}
        real = snap._read_exact

        def spy(f, path, offset, out, read=read, buffers=buffers, real=real):
            read.append(len(out))
            buffers[id(out.obj)] = out.obj  # what the bytes land in (kept alive: unique ids)
            return real(f, path, offset, out)

        reader = {
            "read_manifest": snap.read_manifest,
            "verify_snapshot": snap.verify_snapshot,
            "load_snapshot": lambda p: load_small(p, s.model),
        }[name]
        with mock.patch.object(snap, "_read_exact", spy), time_limit(20):
            try:
                reader(s.path)
                outcome = "ok"
            except QspecError as e:
                assert "\n" not in str(e)  # one line for the CLI
                outcome = "refused"
        allocated = sum(memoryview(b).nbytes for b in buffers.values())
        assert allocated <= size + snap._CHUNK, f"{name}: {allocated} bytes for a {size}-byte file"
        results[name] = (outcome, sum(read))
    return results


def all_refused(results) -> bool:
    return all(outcome == "refused" for outcome, _ in results.values())


def test_the_unmutated_snapshot_is_accepted(snapshot):
    snapshot.path.write_bytes(snapshot.data)
    assert {k: v[0] for k, v in run_readers(snapshot).items()} == dict.fromkeys(READERS, "ok")


@FUZZ
@given(st.data())
def test_any_truncation_is_refused(snapshot, data):
    cut = data.draw(st.integers(0, len(snapshot.data) - 1))
    snapshot.path.write_bytes(snapshot.data[:cut])
    assert all_refused(run_readers(snapshot))


@FUZZ
@given(region=st.sampled_from(["length", "header", "data"]), data=st.data())
def test_any_flipped_bit_is_refused(snapshot, region, data):
    start, end = {
        "length": (0, 8),
        "header": (8, snapshot.header_end),
        "data": (snapshot.header_end, len(snapshot.data)),
    }[region]
    byte = data.draw(st.integers(start, end - 1))
    mutated = bytearray(snapshot.data)
    mutated[byte] ^= 1 << data.draw(st.integers(0, 7))
    snapshot.path.write_bytes(bytes(mutated))
    results = run_readers(snapshot)
    assert results["verify_snapshot"][0] == results["load_snapshot"][0] == "refused"
    # read_manifest reads no data: it must see every header flip, and only those
    assert results["read_manifest"][0] == ("ok" if region == "data" else "refused")


shapes = st.lists(st.integers(0, 2**34), max_size=6)


@FUZZ
@given(
    name=st.sampled_from(schema.TENSORS),
    dim=st.integers(0, 5),
    size=st.integers(0, 2**34),
    shape=st.none() | shapes,
    dtype=st.none() | st.sampled_from(sorted(schema.ITEMSIZE)),
)
def test_a_resized_or_retyped_tensor_is_refused_before_its_data_is_read(
    snapshot, name, dim, size, shape, dtype
):
    changed = []

    def edit(header):
        entry = header[name]
        new_shape = list(entry["shape"]) if shape is None else shape
        if shape is None and new_shape:
            new_shape[dim % len(new_shape)] = size
        changed.append((new_shape, dtype or entry["dtype"]) != (entry["shape"], entry["dtype"]))
        entry["shape"], entry["dtype"] = new_shape, dtype or entry["dtype"]

    snapshot.path.write_bytes(snapshot.data)
    try:
        header_end = _rewrite_header(snapshot.path, edit)
    except (OSError, OverflowError):  # larger than a (sparse) file may be: left short
        header_end = 8 + struct.unpack("<Q", snapshot.path.read_bytes()[:8])[0]
    results = run_readers(snapshot)
    if changed[0]:
        assert all_refused(results)
        assert all(n <= header_end for _, n in results.values())  # not a byte of data


def _key_paths(manifest: dict) -> list[str]:
    paths = []
    for key, value in manifest.items():
        paths.append(key)
        if isinstance(value, dict):
            paths += [f"{key}.{sub}" for sub in value]
    return paths


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)


@FUZZ
@given(data=st.data(), delete=st.booleans(), value=json_values | st.integers(-2, 100))
def test_edited_manifests_with_a_recomputed_checksum(snapshot, data, delete, value):
    original = json.loads(
        json.loads(snapshot.data[8 : snapshot.header_end])["__metadata__"]["manifest"]
    )
    key = data.draw(st.sampled_from(_key_paths(original)))
    *parents, last = key.split(".")

    def edit(manifest):
        obj = manifest
        for parent in parents:
            obj = obj[parent]
        if delete:
            del obj[last]
        else:
            obj[last] = value

    snapshot.path.write_bytes(snapshot.data)
    _rewrite_manifest(snapshot.path, edit, fix_checksum=True)
    results = run_readers(snapshot)
    required = bool(parents) or key in schema.REQUIRED  # nested keys are all required
    if delete and required and key != "manifest_sha256":  # (that one the edit recomputes)
        assert all_refused(results), key


@FUZZ
@given(garbage=st.binary(max_size=4096), framed=st.booleans())
def test_garbage_is_refused(snapshot, garbage, framed):
    if framed:  # a plausible header length in front of it
        garbage = struct.pack("<Q", len(garbage)) + garbage
    snapshot.path.write_bytes(garbage)
    assert all_refused(run_readers(snapshot))


@FUZZ
@given(name=st.sampled_from(schema.TENSORS), value=json_values)
def test_a_garbled_header_entry_is_refused(snapshot, name, value):
    data = snapshot.data
    header = json.loads(data[8 : snapshot.header_end])
    header[name] = value
    raw = json.dumps(header).encode()
    snapshot.path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[snapshot.header_end :])
    assert all_refused(run_readers(snapshot))


def test_special_files_are_refused_without_hanging(snapshot, tmp_path):
    fifo = tmp_path / "fifo.qspec"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path, tmp_path / "missing.qspec", tmp_path / "f" / "x.qspec"):
        with time_limit(10):
            for read in (snap.read_manifest, snap.verify_snapshot):
                with pytest.raises(QspecError):
                    read(path)
