"""Results one rank sends to the others of its group with no tensor pickled: the structure (numbers, names,
shapes) as a Python object on the host, the tensors as tensors on the rank's device, packed into one buffer.

A pickled CUDA tensor would unpickle on the sender's device index -- GPU 4 of the sending node, an invalid
ordinal where a task sees one GPU, as Slurm usually binds -- and ``broadcast_object_list`` on a device syncs
it once per object. Here the structure travels pickled on the host (the group's gloo side: the default group
on CUDA is "cuda:nccl,cpu:gloo", ``strategies.processes.backend_for``), and the receiving ranks rebuild each
tensor on their own device from one byte buffer, which travels over the group's device backend (NCCL on
GPUs), as Megatron-LM sends its step results.

:class:`ResultsChannel` is for what one sender sends every step (the pipeline's step results): the structure
of a step's results is nearly always the previous step's -- the same loss, the same logged names -- so it
travels only when it changes. A steady-state step costs one one-byte host broadcast (did the structure
change?) and one device broadcast of the packed tensors: no pickling and no host sync of device values. On
CPU, where host and device are one, the flag is the packed buffer's first byte: one broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

_HOST = torch.device("cpu")


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the structure: its shape, dtype and bytes in the packed buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


class ResultsChannel:
    """Sends what global rank ``src`` computes every step to every rank of ``group``, the structure only when
    it differs from the previous step's (module doc). Every rank of the group calls :meth:`share` in the same
    steps."""

    def __init__(self, src: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.src, self.group, self.device = src, group, device
        self._host = host_side(group, device)
        self._layout: tuple[Any, int] | None = None  # (structure, bytes of tensors) of the last shared object
        self.structure_sends = 0  # how often the structure travelled (pickled): once, unless the step changes

    def share(self, obj: Any) -> Any:
        """``obj`` (on ``src``; anything on the others) on every rank, its tensors on ``device``."""
        sending = dist.get_rank() == self.src
        layout = _without_tensors(obj) if sending else None
        changed = sending and layout != self._layout
        if self.device.type == "cpu":  # host and device are one: the flag leads the tensors' bytes, one broadcast
            previous = self._layout[1] if self._layout is not None else 0
            flagged = _broadcast_bytes(obj if sending and not changed else None, previous, self.src, self.group,
                                       self.device, flag=changed)
            if not flagged.numpy()[0]:  # numpy(): a host read that dispatches no op
                return _rebuilt(self._layout[0], flagged[1:])
        else:  # the flag on the host, where the group has a host side: reading it syncs no device
            flag = torch.tensor([changed], dtype=torch.uint8, device=self._host)
            dist.broadcast(flag, src=self.src, group=self.group)
            if not (flag.numpy()[0] if flag.device.type == "cpu" else flag.item()):  # numpy(): no device copy
                structure, nbytes = self._layout
                return _rebuilt(structure, _broadcast_bytes(obj if sending else None, nbytes, self.src, self.group,
                                                            self.device))
        box = [layout]
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=self._host)
        self._layout = box[0]
        self.structure_sends += 1
        structure, nbytes = self._layout
        return _rebuilt(structure, _broadcast_bytes(obj if sending else None, nbytes, self.src, self.group,
                                                    self.device))


def share(obj: Any, src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """``obj`` (on global rank ``src``; anything on the others) on every rank of ``group``, its tensors on
    ``device``, once (Lightning's ``strategy.broadcast``): a channel used for one object."""
    return ResultsChannel(src, group, device).share(obj)


def host_side(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where ``group`` takes small host-side values: the host when its backend serves host tensors (gloo, or
    "cuda:nccl,cpu:gloo"), else ``device`` (an NCCL-only group, e.g. one split from the default: reading such a
    value syncs the device, the price of a group without a host side)."""
    if device.type == "cpu" or "gloo" in (dist.get_backend(group) or ""):
        return _HOST
    return device


def _without_tensors(obj: Any) -> tuple[Any, int]:
    """``obj`` with a :class:`_Slot` in each tensor's place (the containers themselves, not a pytree spec, whose
    unpickling warns), and the bytes its tensors take."""
    total = 0

    def slot(leaf: Any) -> Any:
        nonlocal total
        if not isinstance(leaf, Tensor):
            return leaf
        nbytes = leaf.numel() * leaf.element_size()
        total += nbytes
        return _Slot(tuple(leaf.shape), leaf.dtype, total - nbytes, nbytes)

    return tree_map(slot, obj), total


def _broadcast_bytes(obj: Any, nbytes: int, src: int, group: dist.ProcessGroup, device: torch.device,
                     flag: bool | None = None) -> Tensor:
    """The bytes of ``obj``'s tensors (on ``src``; ``nbytes`` of them), in order, on every rank: one broadcast on
    ``device``. With ``flag`` (True or False on ``src``) a first byte carries it; then ``obj`` may be None on
    ``src`` too, and the bytes after the flag are not read."""
    lead = [] if flag is None else [torch.tensor([flag], dtype=torch.uint8, device=device)]
    if obj is not None:
        parts = [_as_bytes(x.detach().to(device)) for x in tree_flatten(obj)[0] if isinstance(x, Tensor)]
        buffer = torch.cat(lead + parts) if lead or parts else torch.empty(0, dtype=torch.uint8, device=device)
    elif lead and dist.get_rank() == src:
        buffer = torch.cat(lead + [torch.zeros(nbytes, dtype=torch.uint8, device=device)])
    else:
        buffer = torch.empty(len(lead) + nbytes, dtype=torch.uint8, device=device)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return buffer


def _as_bytes(tensor: Tensor) -> Tensor:
    """The tensor's values as a flat byte tensor (its bits, any dtype; bool as bytes, which every backend sends)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


def _rebuilt(structure: Any, buffer: Tensor) -> Any:
    def unpacked(slot: _Slot) -> Tensor:
        data = buffer[slot.offset:slot.offset + slot.nbytes].clone()  # its own storage: aligned for any dtype
        values = data.bool() if slot.dtype == torch.bool else data.view(slot.dtype)
        return values.reshape(slot.shape)

    return tree_map(lambda leaf: unpacked(leaf) if isinstance(leaf, _Slot) else leaf, structure)
