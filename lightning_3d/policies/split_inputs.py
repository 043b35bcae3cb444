"""A module inside a split region, run in the per-rank trace as the ranks run it on DTensors.

:class:`~lightning_3d.policies.projections.OnSplitFeatures` gives a module with weights inside a region (a
norm of q and k) every tensor input of its first input's dimensions as this rank's share along one dimension,
its weights whole: DTensor computes what the module computes on the whole inputs and hands back this rank's
share of each output. ZAYA's query and key norm is one: it takes q and k (fewer kv heads than query heads,
both cut along the heads) and scales each kv head of k by its own learned value, which this rank's share alone
would meet with every kv head's values. :class:`SplitInputs` runs it the same way on the meta device.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_map


class SplitInputs:
    """The forward of a module whose inputs are this rank's share along ``dim`` of the whole first input
    ``shape`` (the others' share of the same dimension: the one whose size is not the whole one): each tensor
    input of as many dimensions sits at its place in one tp times as wide there (the other ranks' places hold
    no features), the module's own forward runs on those, and each tensor output is cut back to this rank's
    share along that dimension."""

    def __init__(self, forward, shape, rank: int, tp: int) -> None:
        self.forward, self.shape, self.rank, self.tp = forward, tuple(shape), rank, tp

    def __call__(self, x: Tensor, *args, **kwargs):
        split = [d for d, (a, b) in enumerate(zip(self.shape, x.shape)) if a != b]
        if len(self.shape) != x.dim() or len(split) != 1 or x.shape[split[0]] * self.tp != self.shape[split[0]]:
            raise ValueError(f"the input {list(x.shape)} is not the whole input {list(self.shape)} cut along one dimension")
        dim = split[0]

        def widened(t):
            if not isinstance(t, Tensor) or t.dim() != x.dim():
                return t
            size = t.shape[dim]
            before = [*t.shape[:dim], size * self.rank, *t.shape[dim + 1:]]
            after = [*t.shape[:dim], size * (self.tp - 1 - self.rank), *t.shape[dim + 1:]]
            return torch.cat([t.new_zeros(before), t, t.new_zeros(after)], dim)

        def cut(t):
            if not isinstance(t, Tensor) or t.dim() <= dim or t.shape[dim] % self.tp:
                return t
            share = t.shape[dim] // self.tp
            return t.narrow(dim, self.rank * share, share)
        out = self.forward(widened(x), *tree_map(widened, list(args)), **tree_map(widened, kwargs))
        return tree_map(cut, out)
