"""What callbacks need to know of the layout, also when the strategy is not ThreeDStrategy (then: one replica
per rank, data parallel only)."""

from __future__ import annotations

import lightning as L

from lightning_3d.parallel.dims import ParallelDims


def dims_of(trainer: L.Trainer) -> ParallelDims:
    """The layout of the run: ThreeDStrategy's, or dp = world size for any other strategy."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims if isinstance(dims, ParallelDims) else ParallelDims(dp=trainer.world_size, pp=1, tp=1)

