"""Reductions over a split projection's features: what the block trace records of them, and which a split
would get wrong.

Some code reduces over the output features of a projection: a norm of all of an attention's output before its
row projection (nGPT's and BitNet's sub-norms), a per-head norm of q and k over each head's features. At tp a
rank holds only its share of the features, so a reduction over features of several ranks computed on the local
tensor would see one rank's share. The trace records, for every reduction of traced features, which features
of each projection are reduced together (:func:`reduced_dims`); :func:`across_ranks` finds those a split cuts.
A module that does such a reduction and keeps each feature in its place (a norm, with weights or without)
runs on a DTensor of this rank's share, which reduces over all ranks
(:class:`~lightning_3d.policies.projections.OnSplitFeatures`); any other is refused with its name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

aten = torch.ops.aten
_DIM_ARGUMENT = {
    aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten.amax.default: 1, aten.amin.default: 1, aten.var.correction: 1,
    aten.var_mean.correction: 1, aten.std.correction: 1, aten.max.dim: 1, aten.min.dim: 1, aten.prod.dim_int: 1,
    aten.logsumexp.default: 1, aten.linalg_vector_norm.default: 2, aten.norm.ScalarOpt_dim: 2,
    aten._softmax.default: 1, aten._log_softmax.default: 1,
}
"""Reductions over some dimensions -> the position of their ``dim`` argument."""
_ALL = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.prod.default,
        aten.linalg_vector_norm.default}
"""Reductions over every dimension (when given no ``dim``)."""
_TRAILING = {aten.native_layer_norm.default, aten._fused_rms_norm.default}
"""Norms over the trailing ``normalized_shape`` dimensions."""


@dataclass(frozen=True)
class Reduction:
    """One reduction of traced features: the modules it ran in (outermost first), and per projection the
    features reduced together (at the first element of the dimensions kept)."""

    stack: tuple[str, ...]
    features: dict[str, frozenset[int]]


def reduced_dims(func, args: tuple, kwargs: dict) -> list[int] | None:
    """The dimensions of its first argument ``func`` reduces over; None if it is no reduction."""
    if not args or not isinstance(args[0], Tensor):
        return None
    x = args[0]
    if func in _TRAILING:
        return list(range(x.dim() - len(args[1]), x.dim()))
    dims = None
    if func in _DIM_ARGUMENT:
        position = _DIM_ARGUMENT[func]
        dims = args[position] if len(args) > position else kwargs.get("dim")
    elif func not in _ALL:
        return None
    if dims is None or dims == []:
        return list(range(x.dim()))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % x.dim() for d in dims) if x.dim() else []


def reduced_together(shadow: dict[str, list[Tensor]], dims: list[int], features) -> dict[str, frozenset[int]]:
    """Per projection in ``shadow``, its features the reduction over ``dims`` takes together (at the first
    element of the other dimensions)."""
    found = {}
    for name, slots in shadow.items():
        index = tuple(slice(None) if d in dims else 0 for d in range(slots[0].dim()))
        together = features(s[index] for s in slots)
        if len(together) > 1:
            found[name] = together
    return found


def across_ranks(reductions: list[Reduction], owned: dict[str, list[Tensor]], tp: int) -> list[Reduction]:
    """The reductions that take features of one projection that different ranks hold (``owned``: projection ->
    per rank, the features it keeps): on each rank's local share they would see part of what they reduce."""
    held = {name: [set(share.tolist()) for share in shares] for name, shares in owned.items()}
    cut = []
    for reduction in reductions:
        for name, together in reduction.features.items():
            if name not in held:
                continue
            holders = [r for r in range(tp) if together & held[name][r]]
            whole_everywhere = all(together <= held[name][r] for r in range(tp))
            if len(holders) > 1 and not whole_everywhere:
                cut.append(reduction)
                break
    return cut
