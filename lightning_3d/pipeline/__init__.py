"""Pipeline parallelism: the stage split and the micro-batch engine that runs an unchanged training_step."""

from lightning_3d.pipeline.engine import PipelineEngine
from lightning_3d.pipeline.microbatches import split_batch
from lightning_3d.pipeline.split import assign_blocks, split_stages

__all__ = ["PipelineEngine", "assign_blocks", "split_batch", "split_stages"]
