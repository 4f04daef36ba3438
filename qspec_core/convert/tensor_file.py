"""A safetensors file written one tensor at a time: a model's twins never all in memory.

safetensors puts its JSON header (names, dtypes, shapes, byte offsets) before the data, so a
writer that learns the tensors as it goes reserves the header's room first (`header_room`:
an upper bound from the names it will write), appends each tensor's bytes after it, and
writes the header last, padded with spaces (the format allows trailing whitespace; readers
take the data to start after the header's stated length). Offsets are contiguous from 0,
as the format requires.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# bytes of one header entry beside its name: {"dtype":"BF16","shape":[...],"data_offsets":[..]}
# with up to 4 dimensions and offsets of up to 20 digits
ENTRY_BYTES = 160


def header_room(names, metadata: dict | None = None) -> int:
    """An upper bound of the header's bytes for tensors named `names` (at most 4-D)."""
    meta = len(json.dumps({"__metadata__": metadata or {}}))
    return 8 * ((meta + sum(len(json.dumps(n)) + ENTRY_BYTES for n in names) + 2 + 7) // 8)


class TensorFileWriter:
    """Writes `path` as a safetensors file: `add(name, tensor)` appends, `close(metadata)`
    writes the header into the `room` reserved (`header_room`); ValueError if it does not fit
    or a name repeats. The caller renames the finished file into place (nothing half-written
    is ever at the final name)."""

    def __init__(self, path: Path, room: int):
        self.path = Path(path)
        self.room = room
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(b"\0" * (8 + room))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name} written twice")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: no safetensors dtype for {tensor.dtype}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        end = self.offset + data.nbytes
        shape = list(tensor.shape)
        self.entries[name] = {"dtype": DTYPES[tensor.dtype], "shape": shape,
                              "data_offsets": [self.offset, end]}  # fmt: skip
        self.offset = end

    def close(self, metadata: dict | None = None) -> None:
        header = dict(self.entries)
        if metadata:
            header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self.room:
            self._file.close()
            raise ValueError(f"the header needs {len(text)} bytes, {self.room} were reserved")
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.room) + text + b" " * (self.room - len(text)))
        self._file.flush()
        self._file.close()

    def abort(self) -> None:
        self._file.close()
