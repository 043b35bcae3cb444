"""The layout (config, dims, mesh) and the appliers that turn a single-device model into a parallel one."""

from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.dims import MESH_DIM_NAMES, ParallelDims, RankCoords

__all__ = ["MESH_DIM_NAMES", "ParallelConfig", "ParallelConfigError", "ParallelDims", "RankCoords"]
