"""Running a module written for one device on this rank's local tensors, inside a split region."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from lightning_3d.fused_parts import FusedParts


def gradient_summed(tensor: Tensor, mesh: DeviceMesh) -> Tensor:
    """``tensor`` as it is, whose gradient is summed over ``mesh``: each rank's gradient of it is a share."""
    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


@contextlib.contextmanager
def shadowed(module: nn.Module, tensors: dict[str, Tensor]):
    """While the block runs (inside the context), ``module.<name>`` reads ``tensors[name]`` (an instance attribute shadows the
    registered parameter of that name; ``state_dict`` and the optimizer still see the parameter)."""
    vars(module).update(tensors)
    try:
        yield
    finally:
        for name in tensors:
            del vars(module)[name]


def local_parts(param: DTensor, parts: FusedParts | None, mesh: DeviceMesh) -> Tensor:
    """This rank's piece of ``param``, whose parts every rank keeps whole (``parts``, stored in rank order) have
    their gradients summed over ``mesh``: each rank's gradient of them is a share. The rest is this rank's own."""
    local = param.to_local()
    if parts is None or not parts.whole_rows():
        return local
    pieces, start = [], 0
    for whole_start, length in parts.whole_rows():
        pieces.append(local.narrow(parts.dim, start, whole_start - start))
        pieces.append(gradient_summed(local.narrow(parts.dim, whole_start, length), mesh))
        start = whole_start + length
    pieces.append(local.narrow(parts.dim, start, local.shape[parts.dim] - start))
    return torch.cat(pieces, dim=parts.dim)
