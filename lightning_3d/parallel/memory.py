"""How many bytes of the model this rank holds: parameters, gradients and optimizer state, as local shards."""

from __future__ import annotations

from typing import Iterable

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
