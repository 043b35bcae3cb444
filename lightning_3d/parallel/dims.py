"""The one source of truth for sizes, ranks and sub-meshes of a 3D layout.

Rank layout (the same arithmetic as Megatron-LM, written as PyTorch's row-major ``DeviceMesh``)::

    mesh dims   ("pp", "dp", "tp")            tp varies fastest, pp slowest
    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Example, 8 ranks at dp=2, pp=2, tp=2::

    pp_rank 0:  dp_rank 0 -> ranks [0, 1]   dp_rank 1 -> ranks [2, 3]
    pp_rank 1:  dp_rank 0 -> ranks [4, 5]   dp_rank 1 -> ranks [6, 7]
    tp groups: {0,1} {2,3} {4,5} {6,7}   dp groups: {0,2} {1,3} {4,6} {5,7}   pp groups: {0,4} {1,5} {2,6} {3,7}

Consecutive ranks share a tensor-parallel group, so with ``devices`` ranks per node and tp dividing it, every
TP group (the chattiest one: two collectives per layer) stays inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lightning_3d.common import divisors, is_positive_int
from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError

MESH_DIM_NAMES = ("pp", "dp", "tp")
# Where the world size comes from, for error messages: Lightning's launcher starts num_nodes * devices
# processes, but under torchrun or srun the launcher's count wins and Lightning's devices is not checked.
_WORLD = "the processes started: num_nodes * devices, or the tasks torchrun / srun started"


class RankCoords(NamedTuple):
    """Where one rank sits in the layout."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Resolved sizes of a layout: ``dp * pp * tp == world_size``.

    Example::

        dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2), world_size=8)
        dims.dp, dims.coords(5)        # 4, RankCoords(dp=2, pp=0, tp=1)
        mesh = dims.build_mesh("cpu")  # DeviceMesh with dims ("pp", "dp", "tp")
    """

    dp: int
    """Data-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    tp: int
    """Tensor-parallel size."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}.")

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``data_parallel_size="auto"`` and check the product against the world size (no collectives)."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        model_parallel = tp * pp
        if config.data_parallel_size == "auto":
            if world_size % model_parallel != 0:
                raise ParallelConfigError(
                    f"pipeline_parallel_size ({pp}) * tensor_parallel_size ({tp}) = {model_parallel} does not divide"
                    f" the world size {world_size} ({_WORLD}), so no data-parallel size fits."
                    f" Choose tp * pp among the divisors of {world_size}: {divisors(world_size)}."
                )
            return cls(dp=world_size // model_parallel, pp=pp, tp=tp)
        dp = config.data_parallel_size
        if dp * model_parallel != world_size:
            fix = (
                f" Set data_parallel_size='auto' (-> {world_size // model_parallel}),"
                if world_size % model_parallel == 0
                else f" Choose tp * pp among the divisors of {world_size}: {divisors(world_size)},"
            )
            raise ParallelConfigError(
                f"data_parallel_size ({dp}) * pipeline_parallel_size ({pp}) * tensor_parallel_size ({tp})"
                f" = {dp * model_parallel}, but the world size is {world_size} ({_WORLD}).{fix}"
                f" or launch {dp * model_parallel} processes."
            )
        return cls(dp=dp, pp=pp, tp=tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in ``MESH_DIM_NAMES`` order."""
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> RankCoords:
        """The (dp, pp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return RankCoords(dp=dp_rank, pp=pp_rank, tp=tp_rank)

    def rank(self, coords: RankCoords) -> int:
        """The global rank at given coordinates (inverse of :meth:`coords`)."""
        return coords.tp + self.tp * (coords.dp + self.dp * coords.pp)

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks that share a ``dim`` ("dp", "pp" or "tp") group with ``rank``, in group order."""
        if dim not in MESH_DIM_NAMES:
            raise ValueError(f"dim must be one of {MESH_DIM_NAMES}, got {dim!r}")
        here = self.coords(rank)._asdict()
        return [self.rank(RankCoords(**{**here, dim: i})) for i in range(getattr(self, dim))]

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` of this layout; collective: every rank of the world must call it."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp} = {self.world_size} ranks"

