"""Sharded, reshardable, atomic checkpoints (DCP), their export to one file, and resuming mid-epoch."""

from lightning_3d.checkpoint.convert import consolidate
from lightning_3d.checkpoint.sharded import CheckpointError

__all__ = ["CheckpointError", "consolidate"]
