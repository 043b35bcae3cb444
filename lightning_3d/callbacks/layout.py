"""What callbacks need to know of the layout, also when the strategy is not ThreeDStrategy (then: one replica
per rank, data parallel only), and where the pipeline engine is."""

from __future__ import annotations

import lightning as L

from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.pipeline.engine import PipelineEngine


def dims_of(trainer: L.Trainer) -> ParallelDims:
    """The layout of the run: ThreeDStrategy's, or dp = world size for any other strategy."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims if isinstance(dims, ParallelDims) else ParallelDims(dp=trainer.world_size, pp=1, tp=1)


def pipeline_engine(trainer: L.Trainer) -> PipelineEngine | None:
    """ThreeDStrategy's pipeline engine, or None without pipeline parallelism (or with another strategy)."""
    engine = getattr(trainer.strategy, "pipeline_engine", None)
    return engine if isinstance(engine, PipelineEngine) else None
