"""Safetensors files: read slice by slice with the ``safetensors`` package, written tensor by tensor here.

Reading (``SafetensorsReader``) is the package's: ``safe_open(path, framework="pt").get_slice(name)[region]``
is a view of the memory-mapped file, so copying it into a rank's shard reads only the pages of that region,
for every dtype the package knows (FP8, unsigned, complex). Kept here: a message for a file that is not one
or was cut short, and a new handle for every read. A handle's map keeps every page it touched resident until
it closes, and a slice across columns touches all of a tensor: one handle for a whole load would leave most
of the file resident, a handle per read leaves none, so a rank's memory grows by about one tensor during
``init_from`` (benchmarks/pretrained_memory.py). Opening a handle costs a fraction of a millisecond, which
the load time does not show.

Writing (``SafetensorsWriter``) stays home-made: the package's ``save_file`` / ``serialize_file`` take every
tensor at once, while consolidating a sharded checkpoint (``convert.py``) should hold one tensor at a time.
Since the header only needs names, shapes and dtypes, it is written first and each tensor is streamed into
its place as it becomes available. Files written here load with the package (tests/parity/test_checkpoints.py).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
"""The safetensors format's name of each torch dtype, for the header ``SafetensorsWriter`` writes."""


class SafetensorsWriter:
    """Write tensors whose names, shapes and dtypes are known up front, one at a time, in any order.

    Example::

        with SafetensorsWriter(path, {"w": ((4, 8), torch.float32)}) as writer:
            writer.write("w", torch.randn(4, 8))
    """

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, dict] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for name, (shape, dtype) in specs.items():
            if dtype not in DTYPES:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors equivalent ({sorted(map(str, DTYPES))})")
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
            self._offsets[name] = (position, position + size)
            position += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as the package writes it
        self._specs = specs
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._data_start = self._file.tell()
        self._file.truncate(self._data_start + position)
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shape, dtype = self._specs[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {tuple(shape)} {dtype}")
        begin, end = self._offsets[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.seek(self._data_start + begin)
        self._file.write(data)  # the array's own buffer: a bytes copy would double the CPU time and hold the
        # tensor twice
        self._written.add(name)

    def close(self) -> None:
        missing = sorted(set(self._specs) - self._written)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if missing:
            raise RuntimeError(f"safetensors file closed with {len(missing)} tensors never written: {missing[:5]}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsReader:
    """Names, global shapes and dtypes of a safetensors file's tensors, and any slice of one of them
    (``read(name, index)``, ``copy_into(name, index, out)``) read through ``safetensors.safe_open``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with self._open() as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            self.metadata = f.metadata() or {}
            self._shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
            # The dtype of an empty slice: every dtype the package reads, without a name table to keep up.
            self._dtypes = {name: (s[0:0] if self._shapes[name] else s[()]).dtype for name, s in slices.items()}

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """A copy of ``tensor[index]``, reading only the pages it needs."""
        with self._open() as f:
            return f.get_slice(name)[index].clone()  # a view of the map: the copy outlives the handle

    def copy_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(tensor[index])`` straight from the file's pages (converting floats to ``out``'s dtype).
        A handle per read: its map, and the pages the read touched, go when it closes."""
        with self._open() as f:
            out.copy_(f.get_slice(name)[index])
        return out

    def close(self) -> None:
        """Nothing stays open between reads; kept for callers that close what they open."""

    def _open(self):
        try:
            return safe_open(self.path, framework="pt")
        except SafetensorError as error:
            raise ValueError(f"{self.path} is not a safetensors file, or is truncated (half-written? a copy or download"
                             f" cut short?): the safetensors package says {str(error)!r} of its"
                             f" {self.path.stat().st_size} bytes. Write or fetch it again.") from error
