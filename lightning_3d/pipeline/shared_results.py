"""Results one rank sends to the others of its group with no tensor pickled: the structure (numbers, names,
shapes) as a Python object, the tensors as tensors on the rank's device, packed into one buffer per dtype.

A pickled CUDA tensor would unpickle on the sender's device index -- GPU 4 of the sending node, an invalid
ordinal where a task sees one GPU, as Slurm usually binds -- and ``broadcast_object_list`` syncs the device
once per object. Here the receiving ranks rebuild each tensor on their own device from the packed buffers,
which travel over the group's backend for that device (NCCL on GPUs), as Megatron-LM sends its step results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the structure: its shape, dtype and place in its dtype's buffer."""

    shape: tuple[int, ...]
    dtype: str
    offset: int


def share(obj: Any, src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """``obj`` (on global rank ``src``; anything on the others) on every rank of ``group``, its tensors on
    ``device``. Collective over ``group``: two or more broadcasts (the structure, then one per dtype)."""
    sending = dist.get_rank() == src
    structure = [_without_tensors(obj) if sending else None]
    dist.broadcast_object_list(structure, src=src, group=group)
    shape, sizes = structure[0]
    buffers = _packed(obj, device) if sending else {
        dtype: torch.empty(size, dtype=_carrier(dtype), device=device) for dtype, size in sizes.items()}
    for dtype in sorted(sizes):
        dist.broadcast(buffers[dtype], src=src, group=group)
    return tree_map(lambda leaf: _unpacked(leaf, buffers) if isinstance(leaf, _Slot) else leaf, shape)


def _without_tensors(obj: Any) -> tuple[Any, dict[str, int]]:
    """``obj`` with a :class:`_Slot` in each tensor's place (the containers themselves, not a pytree spec, whose
    unpickling warns), and the elements each dtype's buffer holds."""
    sizes: dict[str, int] = {}

    def slot(leaf: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return leaf
        dtype = _name(leaf.dtype)
        sizes[dtype] = sizes.get(dtype, 0) + leaf.numel()
        return _Slot(tuple(leaf.shape), dtype, sizes[dtype] - leaf.numel())

    return tree_map(slot, obj), sizes


def _packed(obj: Any, device: torch.device) -> dict[str, Tensor]:
    by_dtype: dict[str, list[Tensor]] = {}
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, Tensor):
            dtype = _name(leaf.dtype)
            by_dtype.setdefault(dtype, []).append(leaf.detach().reshape(-1).to(device, _carrier(dtype)))
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _carrier(dtype: str) -> torch.dtype:
    """The dtype a buffer of ``dtype`` travels in (bool as bytes: not every backend sends bool)."""
    return torch.uint8 if dtype == "bool" else getattr(torch, dtype)


def _unpacked(slot: _Slot, buffers: dict[str, Tensor]) -> Tensor:
    size = math.prod(slot.shape)
    values = buffers[slot.dtype][slot.offset:slot.offset + size].reshape(slot.shape).clone()
    return values.bool() if slot.dtype == "bool" else values
