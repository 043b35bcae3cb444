"""The outputs of an inner row that each rank's heads read: all of them, or the rank's own slice.

An inner row reads only a region's columns and feeds its attention or scan, not the residual stream: Mamba's
``x_proj`` (every channel's step size, and the B and C all channels share), Doge's ``dt_proj`` (from the values
of every key/value head to one step per key/value head, which becomes that head's dynamic mask on the scores).
At tp it splits by its inputs, as the columns' features it reads do, and rank r's output is a share of the sum.

* Where the heads of every rank read all of its outputs (Mamba), the sum is all-reduced: every rank computes
  with the whole output, and its gradient there is a share, summed over tp on the way back
  (``RowSplit(output_layouts=Replicate(), summed_gradient=True)``).
* Where the heads of rank r read only the r-th slice of its outputs (Doge: the heads of its key/value heads),
  the sum is reduce-scattered: rank r keeps its slice (``RowSplit(output_layouts=Shard(-1))``), whose gradient
  is its own, and the weights applied to that output per head (Doge's ``A``) split with the heads. The rank's
  block is traced with its slice only, so code that reads another slice is refused by the per-rank check.
"""

from __future__ import annotations

import torch
from torch import Tensor


def head_slices(event, name: str, out: int, heads: int, tp: int) -> list[Tensor] | None:
    """Per tp rank, the outputs of the inner row ``name`` (``out`` of them) its heads read in the attention
    product ``event`` (a :class:`~lightning_3d.policies.block_trace.HeadEvent`), when they are rank r's r-th
    slice for every r; None when any rank's heads read others' (or the outputs do not divide by ``tp``)."""
    if out % tp or heads % tp:
        return None
    read: list[set[int]] = [set() for _ in range(tp)]
    for side in (event.q, event.k, event.v, event.scores):
        for h, features in enumerate(side[:heads]):
            read[h // (heads // tp)] |= features.get(name, frozenset())
    size = out // tp
    slices = [set(range(r * size, (r + 1) * size)) for r in range(tp)]
    return [torch.arange(r * size, (r + 1) * size) for r in range(tp)] if read == slices else None
