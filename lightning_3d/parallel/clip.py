"""Gradient clipping by the true global norm: every gradient of the whole model counted once.

A rank holds a mix of gradients: tp shards (DTensors, each a piece of one full gradient), copies replicated
across tp and dp (plain tensors, or DTensors on the dp mesh), and only its own pipeline stage's. The squared
norm of the whole model is then the sum, over all ranks, of each local squared norm divided by the number of
ranks that hold an identical copy of that piece -- one all-reduce over the world. It equals the norm of the
single-device model's gradient, so clipping changes nothing about parity.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_3d.checkpoint.boxes import local_boxes
from lightning_3d.common import local
from lightning_3d.fused_parts import fused_layouts
from lightning_3d.parallel.dims import ParallelDims

_STAGE_COPIES = WeakIdKeyDictionary()
"""Parameter -> how many pipeline stages hold it, with the same value and gradient (tied weights; 1 if absent)."""


def mark_stage_copies(param: Tensor, copies: int) -> None:
    """Say that ``copies`` pipeline stages hold ``param`` (``lightning_3d.parallel.tied``), so the global
    norm and the parameter count take it once."""
    _STAGE_COPIES[param] = copies


_WHOLE_PARTS = WeakIdKeyDictionary()
"""Parameter -> its layout, for fused projections with parts every tp rank keeps whole (``lightning_3d.fused_parts``)."""


def mark_whole_parts(module: torch.nn.Module) -> None:
    """Record ``module``'s parameters stored with parts every tp rank keeps whole (Falcon's one k and v head),
    so the global norm counts those rows once. Called once data parallel has placed the final parameters."""
    for name, parts in fused_layouts(module).items():
        if any(parts.whole):
            _WHOLE_PARTS[module.get_parameter(name)] = parts


def global_grad_norm(parameters: Iterable[Tensor], dims: ParallelDims) -> Tensor:
    """The 2-norm of the gradients of the whole model (collective over the world; every rank gets it)."""
    total = grad_square_terms(parameters, dims)[0]
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt()


def grad_square_terms(parameters: Iterable[Tensor], dims: ParallelDims) -> tuple[Tensor, Tensor]:
    """This rank's (share of the whole model's squared gradient norm, squared norm of its local gradients).
    The shares of all ranks sum to the squared global norm; no communication.

    One ``torch._foreach_norm`` per group of gradients with the same device, dtype and number of copies (a
    handful of groups, not a kernel per parameter), in float32 (float64 for float64 gradients)."""
    groups: dict[tuple, list[Tensor]] = defaultdict(list)  # (device, dtype, copies) -> local pieces
    device = None  # where the parameters are: the sums go into an all-reduce, which NCCL serves on the GPU only
    for param in parameters:
        device = device or local(param).device
        if param.grad is None:
            continue
        for piece, copies in local_pieces(param.grad, dims, of=param):
            groups[(piece.device, piece.dtype, copies)].append(piece.detach())
    if not groups:  # a rank without gradients (frozen stage) still joins the all-reduce, on its device
        return torch.zeros((), device=device), torch.zeros((), device=device)
    share, local_squares = [], []
    for (_, dtype, copies), pieces in groups.items():
        # float32 at least; float64 gradients ("64-true") in float64, their sums then kept as float32
        wide = torch.promote_types(dtype, torch.float32)
        squares = torch.stack(torch._foreach_norm(pieces, 2, dtype=wide)).square().sum().float()
        local_squares.append(squares)
        share.append(squares / copies)
    return torch.stack(share).sum(), torch.stack(local_squares).sum()


def local_piece(tensor: Tensor, dims: ParallelDims, of: Tensor | None = None) -> tuple[Tensor, int]:
    """This rank's piece of a (possibly sharded) tensor -- a parameter, or ``of``'s gradient -- and how many
    ranks hold that very piece (replicas over dp, cp and tp; a tied weight's copies on the first and last
    pipeline stages too): dividing by it counts every piece of the model once."""
    stage_copies = _STAGE_COPIES.get(tensor if of is None else of, 1)
    if not isinstance(tensor, DTensor):
        return tensor, dims.replicas * dims.tp * stage_copies
    if any(p.is_partial() for p in tensor.placements):
        raise RuntimeError("a pending (Partial) gradient has no local piece yet; reduce it first")
    # Every mesh dimension that is not Replicate splits the tensor; FSDP2 on a (dp, tp) mesh uses
    # _StridedShard for dp, which is not a Shard (is_shard() is False).
    distinct = math.prod(tensor.device_mesh.size(i) for i, p in enumerate(tensor.placements) if not p.is_replicate())
    return tensor.to_local(), dims.replicas * dims.tp // distinct * stage_copies


def local_pieces(tensor: Tensor, dims: ParallelDims, of: Tensor | None = None) -> list[tuple[Tensor, int]]:
    """:func:`local_piece` in pieces that each have one number of holders: one piece, or for a fused
    projection with whole parts (a parameter, or ``of``'s gradient), each box of it (a whole part's rows are
    on every tp rank)."""
    piece, copies = local_piece(tensor, dims, of=of)
    parts = _WHOLE_PARTS.get(tensor if of is None else of)
    if parts is None:
        return [(piece, copies)]
    starts = itertools.accumulate((0, *parts.sizes[:-1]))
    whole = [range(start, start + size) for start, size, is_whole in zip(starts, parts.sizes, parts.whole) if is_whole]
    # Each box lies in one part (local_boxes ends a box where a part does when some part is whole).
    return [(piece[region], copies * dims.tp if any(offsets[parts.dim] in rows for rows in whole) else copies)
            for offsets, _, region in local_boxes(tensor, parts)]


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, dims: ParallelDims) -> Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm`` (as ``torch.nn.utils`` does,
    with the norm of the whole model). Returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(parameters, dims)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    groups: dict[tuple, list[Tensor]] = defaultdict(list)  # (device, dtype) -> gradients
    for param in parameters:
        grad = local(param.grad)
        groups[(grad.device, grad.dtype)].append(grad)
    for (device, dtype), grads in groups.items():
        # The scale in the gradients' dtype, as grad.mul_(scale) would round it: a bf16 gradient is not
        # scaled by a float32 factor.
        torch._foreach_mul_(grads, scale.to(device=device, dtype=dtype))
    return norm


def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (elementwise: no communication)."""
    for param in parameters:
        if param.grad is not None:
            local(param.grad).clamp_(-clip_value, clip_value)


def clip_by_global_norm(precision: Precision, dims: ParallelDims) -> None:
    """Make Lightning's ``precision`` plugin clip by the global norm (``gradient_clip_val`` with the "norm"
    algorithm) and by value over the parameters this rank holds.

    Lightning clips in the precision plugin; under tp/pp a rank holds shards and one stage, so
    ``torch.nn.utils``' local norm is wrong (or fails on mixed DTensors). The plugin has no hook for the norm,
    so its two clip methods are replaced on this instance (what a subclass would do, for any plugin class)."""
    precision.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
        precision.main_params(optimizer), clip_val, dims)
    precision.clip_grad_by_value = lambda optimizer, clip_val: clip_grad_value_(
        precision.main_params(optimizer), clip_val)
