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
CPU, where host and device are one, the flag is the packed buffer's first byte: one broadcast, whose receive
the receiving ranks post before the step's work (:meth:`ResultsChannel.expect`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

_HOST = torch.device("cpu")
_POSTED_ON: set[int] = set()  # id() of the groups where a receive posted ahead (expect) is still waiting


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
    steps. Where receives are posted ahead (:meth:`expect`, on CPU) the group must serve nothing else: such a
    receive would hold up, or be taken for, any other collective on it."""

    def __init__(self, src: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.src, self.group, self.device = src, group, device
        self._host = host_side(group, device)
        self._layout: tuple[Any, int] | None = None  # (structure, bytes of tensors) of the last shared object
        self._posted: _Posted | None = None  # this step's receive, posted ahead (expect)
        self.structure_sends = 0  # how often the structure travelled (pickled): once, unless the step changes

    def expect(self) -> None:
        """On a receiving rank, before the work whose results the next :meth:`share` brings: post that receive
        now, so that the bytes land while this rank computes and :meth:`share` finds them there. Left to
        :meth:`share`, the receive waits then for the sender to answer its handshake: a wake-up of the sending
        process, which is slow where ranks share cores. Where host and device
        are one (CPU), once the structure is known; on a GPU a receive posted ahead would be an NCCL kernel
        waiting on the device through the whole step, and an answer takes microseconds there."""
        if self.device.type == "cpu" and self._layout is not None and self._posted is None \
                and dist.get_rank() != self.src:
            self._posted = self._post()
            _POSTED_ON.add(id(self.group))

    def share(self, obj: Any) -> Any:
        """``obj`` (on ``src``; anything on the others) on every rank, its tensors on ``device``."""
        sending = dist.get_rank() == self.src
        layout = _without_tensors(obj) if sending else None
        if self._layout is not None:  # every rank knows the last structure: a flag, then bytes of its size
            if sending:
                changed = layout != self._layout
                data = self._send(None if changed else obj, changed)
            else:
                posted, self._posted = self._posted or self._post(), None
                changed, data = posted.wait(), posted.data
                _POSTED_ON.discard(id(self.group))
            if not changed:
                return _rebuilt(self._layout[0], data)
        box = [layout]
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=self._host)
        self._layout = box[0]
        self.structure_sends += 1
        structure, nbytes = self._layout
        return _rebuilt(structure, _broadcast_bytes(obj if sending else None, nbytes, self.src, self.group,
                                                    self.device))

    def _post(self) -> "_Posted":
        """The receive of a flag (did the structure change?) and of the last structure's bytes after it."""
        nbytes = self._layout[1]
        if self.device.type == "cpu":  # host and device are one: the flag leads the bytes, one broadcast
            buffer = torch.empty(1 + nbytes, dtype=torch.uint8)
            return _Posted(buffer[:1], buffer[1:], [dist.broadcast(buffer, src=self.src, group=self.group,
                                                                   async_op=True)])
        flag = torch.empty(1, dtype=torch.uint8, device=self._host)  # on the host, where the group has a host side
        data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        works = [dist.broadcast(flag, src=self.src, group=self.group, async_op=True)]
        if nbytes:
            works.append(dist.broadcast(data, src=self.src, group=self.group, async_op=True))
        return _Posted(flag, data, works)

    def _send(self, obj: Any, changed: bool) -> Tensor:
        """What :meth:`_post` receives: the flag, then ``obj``'s bytes, or zeros of the last structure's size when
        the structure changed (its bytes follow the new structure). Returns those bytes."""
        nbytes = self._layout[1]
        data = _bytes_of(obj, self.device) if obj is not None else torch.zeros(nbytes, dtype=torch.uint8,
                                                                              device=self.device)
        flag = torch.tensor([changed], dtype=torch.uint8, device=self.device if self.device.type == "cpu"
                            else self._host)
        if self.device.type == "cpu":
            dist.broadcast(torch.cat([flag, data]), src=self.src, group=self.group)
            return data
        dist.broadcast(flag, src=self.src, group=self.group)
        if nbytes:
            dist.broadcast(data, src=self.src, group=self.group)
        return data


@dataclass
class _Posted:
    """A receive of :meth:`ResultsChannel._post`, in flight until :meth:`wait`."""

    flag: Tensor
    data: Tensor
    works: list

    def wait(self) -> bool:
        """Whether the structure changed, once the receive is complete (reading the flag: a host read)."""
        for work in self.works:
            work.wait()
        return bool(self.flag.numpy()[0] if self.flag.device.type == "cpu" else self.flag.item())


def awaits_results(group: dist.ProcessGroup) -> bool:
    """Whether a receive posted ahead on ``group`` still waits: its step failed before the results came. Such a
    receive cannot be taken back, and it would take the next results sent over the group for its own."""
    return id(group) in _POSTED_ON


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


def _broadcast_bytes(obj: Any, nbytes: int, src: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """The bytes of ``obj``'s tensors (on ``src``; ``nbytes`` of them), in order, on every rank: one broadcast on
    ``device``."""
    buffer = _bytes_of(obj, device) if obj is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return buffer


def _bytes_of(obj: Any, device: torch.device) -> Tensor:
    """``obj``'s tensors as one byte tensor on ``device``, in order."""
    parts = [_as_bytes(x.detach().to(device)) for x in tree_flatten(obj)[0] if isinstance(x, Tensor)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


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
