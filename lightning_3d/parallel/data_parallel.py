"""Data parallel over the "dp" mesh dimension: gradients reduced per block, overlapped with backward."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule


def apply_data_parallel(root: nn.Module, blocks: list[str], dp_mesh: DeviceMesh) -> None:
    """Replicate ``root`` over ``dp_mesh`` (zero_stage=0), one gradient all-reduce per block.

    PyTorch's composable ``replicate`` (the DDP of the FSDP2 family, which ``torch.distributed.pipelining``
    knows how to drive) is applied to each block first, then to the root for the remaining parameters:
    each block's all-reduce starts as soon as its backward is done, while earlier blocks still compute --
    the overlap DDP gets from its buckets. It works on meta-device parameters, so it runs before
    materialization and never needs the full model anywhere. FQNs stay those of the single-device model.
    """
    for fqn in blocks:
        replicate(root.get_submodule(fqn), mesh=dp_mesh)
    replicate(root, mesh=dp_mesh)


@contextmanager
def no_gradient_sync(root: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no dp reduction) inside the block, e.g. for gradient accumulation."""
    if not isinstance(root, FSDPModule):
        yield
        return
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
