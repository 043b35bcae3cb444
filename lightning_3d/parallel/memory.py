"""How many bytes of the model this rank holds: parameters, gradients and optimizer state, as local shards."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_3d.common import local


def memory_report(module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (only what the rank stores: the local
    piece of a DTensor shard, this rank's pipeline stages). Local; no communication.

    Example::

        memory_report(trainer.lightning_module, trainer.optimizers)
        # {"parameters": 1180160, "gradients": 1180160, "optimizer_state": 2360336}
    """
    params = list(module.parameters())
    states = [value for optimizer in optimizers for state in optimizer.state.values() for value in state.values()]
    return {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(_local_bytes(t) for t in states if isinstance(t, Tensor)),
    }


class SavedActivations:
    """The most bytes autograd holds for backward at once while the context is entered
    (``saved_tensors_hooks``), parameters excluded, each storage counted once however many ops save it or views
    of it. Local; no communication. It looks at every saved tensor: for measuring, not for timed steps.

    Example::

        saved = SavedActivations(trainer.lightning_module)
        with saved:
            loss = module.training_step(batch, 0); loss.backward()
        saved.peak  # bytes
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, handles alive]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: Tensor):
        # A DTensor's memory is its local shard (no_grad: reading it adds nothing to the graph being saved for);
        # FSDP swaps parameters while it gathers them, so the parameter addresses are read at each call.
        with torch.no_grad():
            piece = local(tensor)
            params = {local(p).untyped_storage().data_ptr() for p in self.module.parameters()}
        key = piece.untyped_storage().data_ptr()
        if key in params or piece.device.type == "meta":
            return tensor
        entry = self.live.setdefault(key, [piece.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        # Detached: an op's saved output keeps its grad_fn, which holds this handle -- a cycle through C++ that
        # Python's collector cannot see, so a graph a backward kept (retain_graph) would never be freed.
        return _SavedHandle(tensor.detach(), key, self)

    @staticmethod
    def _unpack(handle):
        return handle.tensor if isinstance(handle, _SavedHandle) else handle

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


class _SavedHandle:
    """What autograd keeps in place of a saved tensor; freed with the graph, which ends the tensor's count."""

    def __init__(self, tensor: Tensor, key: int, owner: SavedActivations) -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


def host_memory_available() -> int | None:
    """Bytes of host memory this process can still allocate: Linux's ``MemAvailable``, less where a cgroup
    (a container, a Slurm job) caps the memory lower. None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as meminfo:
            found += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as used:
            cap = limit.read().strip()
            if cap != "max":
                found.append(int(cap) - int(used.read().strip()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _local_bytes(tensor: Tensor) -> int:
    piece = local(tensor)
    return piece.numel() * piece.element_size()


def step_gradient_bytes(stages: Iterable[nn.Module], per_microbatch: bool) -> int:
    """The most gradient bytes this rank holds at once within a training step, for pipeline stages under ZeRO
    (FSDP2 units: blocks and the stage). Local; no communication.

    ``pipeline_reduce_grads="per_step"``: the whole gradients (gathered over dp) of every stage, until the
    step's last backward. ``"per_microbatch"``: the dp shards, plus the stage unit's whole gradient (the head's
    is computed first and reduced last) and one block's. Several stages on a rank (interleaving) add up: an
    upper bound there.

    Example::

        step_gradient_bytes(strategy.pipeline_engine.stages.values(), per_microbatch=False)
    """
    total = 0
    for stage in stages:
        units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        whole = {unit: sum(_dp_gathered_bytes(p) for p in _own_parameters(unit)) for unit in units}
        if not per_microbatch:
            total += sum(whole.values())
            continue
        blocks = [whole[u] for u in units if u is not stage]
        total += sum(_local_bytes(p) for p in stage.parameters()) + whole.get(stage, 0) + max(blocks, default=0)
    return total


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters an FSDP2 unit reduces itself: its own, less those of units nested in it."""
    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


def _dp_gathered_bytes(param: Tensor) -> int:
    """Bytes of ``param`` gathered over "dp" (still split over "tp" where tensor parallelism splits it)."""
    if not isinstance(param, DTensor):
        return _local_bytes(param)
    numel = param.numel()
    mesh = param.device_mesh
    for name, size, placement in zip(mesh.mesh_dim_names or (), mesh.shape, param.placements):
        if name != "dp" and placement.is_shard():
            numel //= size
    return numel * param.element_size()


def summarize_memory(report: dict[str, int], describe_rank: Callable[[int], str]) -> str:
    """Every rank's ``memory_report`` gathered into one line (collective: every rank calls it)."""
    reports = [report]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    mib = 2**20
    parts = [f"{key.replace('_', ' ')} {min(r[key] for r in reports) / mib:.1f}-{max(r[key] for r in reports) / mib:.1f}"
             for key in report]
    largest = max(range(len(reports)), key=lambda r: sum(reports[r].values()))
    return (f"memory per rank (MiB, min-max over {len(reports)} ranks): {', '.join(parts)}; most on"
            f" {describe_rank(largest)}")
