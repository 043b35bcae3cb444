"""Record every collective and point-to-point operation of one step: its process group, bytes and interval.

Every communication path of a 3D run reaches PyTorch's dispatcher as an operator that names its process
group: DTensor (tensor parallel) issues functional collectives, ``torch.ops._c10d_functional.*(...,
group_name)``; everything else -- ``torch.distributed.*`` calls from FSDP2's ``replicate``, the pipeline's
``batch_isend_irecv``, and DDP's C++ reducer alike -- goes through ``torch.ops.c10d.*(..., ProcessGroup,
...)``. One ``TorchDispatchMode`` therefore sees all of them, with their tensors, and nothing has to be
patched. (The profiler's communication events were the other candidate: on gloo they do not name the process
group, so they cannot be attributed to tp, pp or dp.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The operators that move data, by namespace (barriers move none; wait_tensor is handled on its own).
COMMUNICATION = {
    "c10d": {"allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
             "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
             "reduce_scatter_tensor_coalesced_", "broadcast_", "reduce_", "gather_", "scatter_", "alltoall_",
             "alltoall_base_", "send", "recv_", "recv_any_source_"},
    "_c10d_functional": {"all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                         "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
                         "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
                         "all_to_all_single", "broadcast", "broadcast_"},
}


@dataclass
class Collective:
    """One communication operation as this rank saw it."""

    op: str
    group_ranks: tuple[int, ...]
    """The global ranks of its process group."""
    bytes: int
    """The largest buffer it touches: the tensor for all-reduce, send and receive; the gathered output for
    all-gather; the full input for reduce-scatter (the message size as nccl-tests reports it)."""
    start: Any
    end: Any = None


class CommRecorder(TorchDispatchMode):
    """Records, while active, each communication operation of this thread (and of the autograd engine it
    drives): which group, how many bytes, and when it was issued and completed.

    Completion is when its ``Work`` finishes (a callback on the work's future) for ``torch.ops.c10d``
    operations, and when its ``wait_tensor`` returns for functional collectives. Times come from ``clock``:
    host seconds on CPU; CUDA events on GPU (read after the step has been synchronized).

    ``torch.compile``'d blocks run compiled under it (:meth:`ignore_compile_internals`); it sees the collectives
    their compiled code calls, which inductor leaves as operator calls.
    """

    lightning_3d_observes_only = True  # parallel/compile.py's OBSERVES_ONLY: compiled blocks run compiled under it

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: dynamo traces and compiles with this mode off and runs the compiled code with it on, rather
        than running any frame eagerly under it (``parallel/compile.py`` does the same for the blocks)."""
        return True

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.collectives: list[Collective] = []
        self._awaiting: dict[int, tuple[torch.Tensor, Collective]] = {}  # functional output -> its record
        self._ranks: dict[str, tuple[int, ...]] = {}  # group name -> its global ranks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            # DTensor first turns the call into plain-tensor ops, collectives among them, which come back
            # through this mode. (A subclass too: logits sharded over the vocabulary are a ShardedLogits.)
            return NotImplemented
        namespace = getattr(func, "namespace", None)
        if namespace not in COMMUNICATION:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "wait_tensor" and namespace == "_c10d_functional":
            out = func(*args, **kwargs)
            awaited = self._awaiting.pop(id(args[0]), None)
            if awaited is not None:
                awaited[1].end = self.clock.now()
            return out
        if name not in COMMUNICATION[namespace]:
            return func(*args, **kwargs)
        record = Collective(op=name, group_ranks=self._group_ranks(args, kwargs), bytes=0, start=self.clock.now())
        out = func(*args, **kwargs)
        record.bytes = max(_nbytes(x) for x in (*args, *kwargs.values(), out))
        work = next((x for x in tree_flatten(out)[0] if _is_script_object_of(x, "Work")), None)
        if work is not None:
            _when_done(dist.Work.unbox(work), record, self.clock)
        elif isinstance(out, torch.Tensor):
            self._awaiting[id(out)] = (out, record)  # the tensor is kept so that its id is not reused
        else:
            record.end = self.clock.now()
        self.collectives.append(record)
        return out

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        for _, record in self._awaiting.values():  # never waited for inside the step
            record.end = record.start
        self._awaiting.clear()


    def _group_ranks(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        # By ranks, not by name: DTensor caches redistribution plans per mesh *shape*, so in a process that
        # builds a second mesh of the same shape it may communicate over the first mesh's (equal) groups.
        group = next((x for x in (*args, *kwargs.values()) if _is_script_object_of(x, "ProcessGroup")), None)
        if group is not None:  # torch.ops.c10d: the dispatcher passes the group boxed
            group = dist.ProcessGroup.unbox(group)
            name = group.group_name
        else:  # functional collectives end with the group's name; the reduce op, also a str, comes before it
            name = [x for x in (*args, *kwargs.values()) if isinstance(x, str)][-1]
        if name not in self._ranks:
            # The name -> group registry has no public accessor; functional collectives resolve names with it.
            group = group or _resolve_process_group(name)
            self._ranks[name] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[name]


def _is_script_object_of(x: Any, class_name: str) -> bool:
    return isinstance(x, torch.ScriptObject) and x._type().name() == class_name


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def _when_done(work: dist.Work | None, record: Collective, clock: Clock) -> None:
    def done(future: torch.futures.Future) -> None:
        record.end = clock.now()

    if work is None:  # NCCL's boxed Work unboxes to None (seen on an H200, torch 2.11): no future to wait on
        record.end = clock.now()
        return
    try:
        # ``then`` (not add_done_callback): on CUDA its callback runs on streams that wait for the work.
        work.get_future().then(done)
    except RuntimeError:  # a backend without futures for this operation: the call's return is all we know
        record.end = clock.now()


class Clock:
    """Host time in seconds (``perf_counter``)."""

    def now(self) -> Any:
        return time.perf_counter()

    def seconds(self, mark: Any, origin: Any) -> float:
        return mark - origin

    def synchronize(self) -> None:
        pass


class CudaClock(Clock):
    """CUDA events on the current stream. An event recorded in a work's completion callback runs on a stream
    that waits for that work, so it completes when the collective has finished on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any, origin: Any) -> float:
        return origin.elapsed_time(mark) / 1e3

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def clock_for(device: torch.device) -> Clock:
    return CudaClock(device) if device.type == "cuda" else Clock()


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals: concurrent operations count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total

