"""A batch cut into micro-batches, and the micro-batches' outputs joined back into one batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_3d.errors import ParallelConfigError


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """The batch (any pytree) cut into ``num_microbatches`` along dim 0 of every tensor; sizes must divide."""
    leaves, spec = tree_flatten(batch)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    sizes = {x.shape[0] for x in tensors if x.dim() > 0}
    for size in sizes:
        if size % num_microbatches:
            raise ParallelConfigError(
                f"The batch has {size} samples per data-parallel rank, which num_microbatches={num_microbatches}"
                f" does not divide. Choose a batch size per dp rank that is a multiple of {num_microbatches}, or"
                f" another num_microbatches among the divisors of {size}."
            )
    chunks = [torch.tensor_split(x, num_microbatches) if isinstance(x, Tensor) and x.dim() > 0
              else [x] * num_microbatches for x in leaves]
    return [tree_unflatten([chunk[i] for chunk in chunks], spec) for i in range(num_microbatches)]


def concatenate(outputs: list[Any]) -> Any:
    """Per-micro-batch outputs as one batch: tensors (also inside lists, tuples, dicts) joined along dim 0."""
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    if any(f[1] != spec for f in flat):
        return outputs
    joined = [torch.cat(leaves) if isinstance(leaves[0], Tensor) and leaves[0].dim() > 0 else list(leaves)
              for leaves in zip(*(f[0] for f in flat))]
    return tree_unflatten(joined, spec)
