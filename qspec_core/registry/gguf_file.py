"""A GGUF file's metadata and tensor table, read with `struct` from a memory map.

GGUF (llama.cpp's format, little-endian, versions 2 and 3): the magic `GGUF`, a version, the
tensor and key counts, the key/value metadata, one entry per tensor (name, dims fastest-moving
first, ggml type, offset), then the tensor data from the next `general.alignment` boundary.
`gguf.GGUFReader` reads the same, but wraps every string of the vocabulary and merge table in a
numpy view: 2-4 s for SmolLM2's 98k strings and 9 s for Qwen2.5's 300k, against 0.1-0.3 s here.
The block layouts stay the `gguf` package's (`GGML_QUANT_SIZES`, `gguf.quants.dequantize`).

A damaged file (cut short, bad magic, a tensor past the end) is a `QspecError` naming it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from qspec_core.errors import QspecError

# fixed-size metadata values: their struct code (strings and arrays are read apart)
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_VERSIONS = (2, 3)  # what gguf.GGUFReader reads too (v1 counted in 32 bits)
DEFAULT_ALIGNMENT = 32  # llama.cpp's, when the file sets no `general.alignment`


class BigEndianGGUF(Exception):
    """A big-endian GGUF: valid, but not read here (the caller can hand it to another reader)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first (GGUF lists the fastest dim first)
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block_size * type_size

    @property
    def nbytes(self) -> int:
        return prod(self.shape[:-1]) * self.row_bytes


class GGUFFile:
    """The metadata (`meta`: key -> value, arrays as lists) and tensors of one GGUF file.

    `raw(info)` is the tensor's bytes as a uint8 array `[*rows, row_bytes]`, the layout
    `gguf.quants.dequantize` takes; it maps the file, and reads only what is touched.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = path.stat().st_size
                if size < 24:
                    raise self.damaged(f"{size} bytes, too short for a GGUF header")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise QspecError(f"cannot read GGUF {path}: {e.strerror or e}") from None
        try:
            self._read_header()
        except (struct.error, UnicodeError, ValueError, KeyError, OverflowError, MemoryError) as e:
            # struct.error: a count or length runs past the end; ValueError: an unknown type
            reason = (str(e).splitlines() or [""])[0]
            raise self.damaged(f"truncated or corrupt ({type(e).__name__}: {reason})") from None

    def damaged(self, reason: str) -> QspecError:
        return QspecError(f"cannot read GGUF {self.path}: {reason}")

    def _read_header(self) -> None:
        buf = self._map
        if buf[:4] != b"GGUF":
            raise self.damaged(f"not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF')")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in _VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in _VERSIONS:
                raise BigEndianGGUF(f"{self.path} is a big-endian GGUF")
            raise self.damaged(f"GGUF version {version} (readable: 2 and 3)")
        n_tensors, n_keys = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.meta: dict = {}
        for _ in range(n_keys):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.meta[key] = self._value(GGUFValueType(kind))
        self.tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            info = TensorInfo(name, tuple(reversed(dims)), GGMLQuantizationType(ggml_type), offset)
            block_size, _ = GGML_QUANT_SIZES[info.ggml_type]
            if not dims or dims[0] % block_size:
                raise self.damaged(f"tensor {name} has shape {info.shape}, not whole blocks")
            self.tensors.append(info)
        alignment = self.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise self.damaged(f"general.alignment is {alignment!r}")
        self._data_start = -(-self._pos // alignment) * alignment
        size = len(buf)
        for info in self.tensors:
            end = self._data_start + info.offset + info.nbytes
            if end > size:
                raise self.damaged(
                    f"truncated: tensor {info.name} ends at byte {end:,}, the file has {size:,}"
                )

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        if start + length > len(self._map):
            raise self.damaged(f"truncated: a string of {length:,} bytes runs past the end")
        self._pos = start + length
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, kind: GGUFValueType):
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item, count = self._unpack("<IQ")
            item = GGUFValueType(item)
            if item in _SCALARS:  # token types, scores: one unpack for the whole array
                code = _SCALARS[item]
                if count * struct.calcsize(code) > len(self._map) - self._pos:
                    raise self.damaged(f"truncated: an array of {count:,} values runs past the end")
                return list(self._unpack(f"<{count}{code}"))
            return [self._value(item) for _ in range(count)]
        raise ValueError(f"metadata value type {kind}")

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, `[*shape[:-1], row_bytes]` uint8 (a view of the mapped file)."""
        data = np.frombuffer(
            self._map, dtype=np.uint8, count=info.nbytes, offset=self._data_start + info.offset
        )
        return data.reshape(*info.shape[:-1], info.row_bytes)
