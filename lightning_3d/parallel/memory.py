"""How many bytes of the model this rank holds: parameters, gradients and optimizer state, as local shards."""

from __future__ import annotations

from typing import Callable, Iterable

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


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


def _local_bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


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
