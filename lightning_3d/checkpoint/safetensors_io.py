"""The safetensors file format, written tensor by tensor and read slice by slice, without the package.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape and
byte offsets into the data section; optional ``__metadata__``), then the raw little-endian bytes. Because
the header only needs shapes and dtypes, a writer can put it down first and then stream each tensor as it
becomes available (``SafetensorsWriter``), so consolidating a sharded checkpoint never holds more than one
tensor; and a reader can memory-map the file and hand out any slice of any tensor without reading the rest
(``SafetensorsReader``). Files written here load with the ``safetensors`` package and vice versa.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


class SafetensorsWriter:
    """Write tensors whose names, shapes and dtypes are known up front, one at a time, in any order.

    Example::

        with SafetensorsWriter(path, {"w": ((4, 8), torch.float32)}) as writer:
            writer.write("w", torch.randn(4, 8))
    """

    def __init__(self, path: str | os.PathLike, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, dict] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for name, (shape, dtype) in layout.items():
            if dtype not in DTYPES:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors equivalent ({sorted(map(str, DTYPES))})")
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
            self._offsets[name] = (position, position + size)
            position += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as the package writes it
        self._layout = layout
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._data_start = self._file.tell()
        self._file.truncate(self._data_start + position)
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shape, dtype = self._layout[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {tuple(shape)} {dtype}")
        begin, end = self._offsets[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        self._file.seek(self._data_start + begin)
        self._file.write(data)
        self._written.add(name)

    def close(self) -> None:
        missing = sorted(set(self._layout) - self._written)
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
    """Memory-mapped reading of a safetensors file: ``shape(name)``, ``dtype(name)``, and ``read(name,
    index)`` with an index of slices along the leading dimensions, which touches only those bytes."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            try:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length)) if 8 + length <= size else None
            except (struct.error, ValueError):
                header = None
            if header is None:
                raise ValueError(f"{self.path} is not a safetensors file, or it was cut short in its header.")
            end = 8 + length + max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
            if end > size:
                raise ValueError(f"{self.path} is truncated (half-written?): its header describes {end} bytes, the"
                                 f" file has {size}.")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata = header.pop("__metadata__", {})
        self._entries = header
        self._data_start = 8 + length

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[self._entries[name]["dtype"]]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """A copy of ``tensor[index]``, reading only the pages it needs."""
        shape = self.shape(name)
        out = torch.empty(torch.empty(shape, device="meta")[index].shape, dtype=self.dtype(name))
        return self.copy_into(name, index, out)

    def copy_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(tensor[index])`` straight from the file's pages, which are given back afterwards."""
        entry = self._entries[name]
        dtype, shape = self.dtype(name), self.shape(name)
        begin, end = entry["data_offsets"]
        if end == begin:
            return out
        with warnings.catch_warnings():  # a read-only map: the view is only ever read from
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(self._map, dtype=dtype, count=math.prod(shape), offset=self._data_start + begin)
        out.copy_(whole.reshape(shape)[index])
        del whole
        self._release(self._data_start + begin, self._data_start + end)
        return out

    def _release(self, begin: int, end: int) -> None:
        """Give the file pages of [begin, end) back: a slice across columns touches every page of a tensor,
        and without this they would stay in this process's resident memory until the map is closed."""
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            page = mmap.PAGESIZE
            first, last = (begin // page) * page, -(-end // page) * page
            self._map.madvise(mmap.MADV_DONTNEED, first, min(last, len(self._map)) - first)

    def close(self) -> None:
        self._map.close()

