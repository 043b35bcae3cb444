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

HSDP (``data_parallel_shard_size`` below dp) splits "dp" in two, shard fastest::

    mesh dims   ("pp", "dp_replicate", "dp_shard", "tp")      dp_rank = replica * dp_shard + shard
    8 ranks at dp=4 (2 replicas x 2 shards), tp=2: dp_shard groups {0,2} {1,3} {4,6} {5,7},
    dp_replicate groups {0,4} {1,5} {2,6} {3,7}

and the two are flattened back into "dp" (``mesh["dp"]``), which every user of dp keeps reading: the data,
the loss's mean, the checks. Only ZeRO reads the pair (FSDP2 on a 2D mesh: shards over "dp_shard", replicas
over "dp_replicate").

Context parallelism (``context_parallel_size`` above 1) adds "cp" between "dp" and "tp", as torchtitan places
it: the ranks of a cp group see the same batch and hold the same weights, each a part of every sequence::

    mesh dims   ("pp", "dp", "cp", "tp")      global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Their gradients are reduced, and ZeRO shards, over "dp" and "cp" together (``mesh["dp_cp"]``, the pair
flattened); the data and the loss's mean stay on "dp".

Expert parallelism (``expert_parallel_size`` above 1) borrows its ranks from dp, as torchtitan's does: "dp" is
split in two, the ep ranks fastest, so an ep group is ``ep`` consecutive dp ranks::

    mesh dims   ("pp", "dp_mod_ep", "ep", "tp")      dp_rank = dp_mod_ep_rank * ep + ep_rank
    8 ranks at dp=4, ep=2, tp=2: ep groups {0,2} {1,3} {4,6} {5,7}, dp_mod_ep groups {0,4} {1,5} {2,6} {3,7}

and the two are flattened back into "dp". Each rank of an ep group holds 1/ep of every mixture-of-experts
layer's experts and sees its own data; the ranks of a "dp_mod_ep" group hold the same experts and reduce (or
ZeRO-shard) their gradients (``lightning_3d.parallel.expert_parallel``). Everything but the experts reads "dp"
as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lightning_3d.common import divisors, is_positive_int
from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.group_cache import once_per_world

MESH_DIM_NAMES = ("pp", "dp", "tp")
HSDP_MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
CP_MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
EP_MESH_DIM_NAMES = ("pp", "dp_mod_ep", "ep", "tp")
# Where the world size comes from, for error messages: Lightning's launcher starts num_nodes * devices
# processes, but under torchrun or srun the launcher's count wins and Lightning's devices is not checked.
_WORLD = "the processes started: num_nodes * devices, or the tasks torchrun / srun started"


class RankCoords(NamedTuple):
    """Where one rank sits in the layout."""

    dp: int
    pp: int
    tp: int
    cp: int = 0


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
    dp_shard: int = 0
    """Of dp, the ranks that shard the model among themselves (HSDP); 0 (the default) or dp: all of them."""
    cp: int = 1
    """Context-parallel size: ranks that split each sequence (same batch, same weights)."""
    ep: int = 1
    """Expert-parallel size: of dp, the ranks that split every mixture-of-experts layer's experts among
    themselves (each its own data); not extra ranks."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "cp", "ep"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}.")
        if self.dp_shard == 0:
            object.__setattr__(self, "dp_shard", self.dp)
        if self.cp > 1 and self.hsdp:
            raise ParallelConfigError(
                f"context_parallel_size={self.cp} with data_parallel_shard_size={self.dp_shard} (HSDP): ZeRO shards over"
                " dp x cp together, and HSDP's split of that is not supported. Leave data_parallel_shard_size='auto'.")
        if self.ep > 1:
            _check_expert_parallel(self)
        if not is_positive_int(self.dp_shard) or self.dp % self.dp_shard:
            raise ParallelConfigError(
                f"data_parallel_shard_size ({self.dp_shard}) must divide the data-parallel size ({self.dp}): the"
                f" dp ranks form dp / shard replicas of one shard group. Choose among {divisors(self.dp)}.")

    @property
    def dp_replicate(self) -> int:
        """Replicas of one shard group (HSDP); 1 when ZeRO shards over all of dp."""
        return self.dp // self.dp_shard

    @property
    def hsdp(self) -> bool:
        """dp is split into replicas of shard groups."""
        return self.dp_shard < self.dp

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``data_parallel_size="auto"`` and check the product against the world size (no collectives)."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        cp = getattr(config, "context_parallel_size", 1)
        ep = getattr(config, "expert_parallel_size", 1)
        model_parallel = tp * pp * cp
        sizes = f"pipeline_parallel_size ({pp}) * tensor_parallel_size ({tp})" + (
            f" * context_parallel_size ({cp})" if cp > 1 else "")
        if config.data_parallel_size == "auto":
            if world_size % model_parallel != 0:
                raise ParallelConfigError(
                    f"{sizes} = {model_parallel} does not divide the world size {world_size} ({_WORLD}), so no"
                    f" data-parallel size fits. Choose their product among the divisors of {world_size}:"
                    f" {divisors(world_size)}."
                )
            return cls(dp=world_size // model_parallel, pp=pp, tp=tp, cp=cp, dp_shard=_shard(config), ep=ep)
        dp = config.data_parallel_size
        if dp * model_parallel != world_size:
            fix = (
                f" Set data_parallel_size='auto' (-> {world_size // model_parallel}),"
                if world_size % model_parallel == 0
                else f" Choose the product among the divisors of {world_size}: {divisors(world_size)},"
            )
            raise ParallelConfigError(
                f"data_parallel_size ({dp}) * {sizes} = {dp * model_parallel}, but the world size is {world_size}"
                f" ({_WORLD}).{fix} or launch {dp * model_parallel} processes."
            )
        return cls(dp=dp, pp=pp, tp=tp, cp=cp, dp_shard=_shard(config), ep=ep)

    @property
    def dp_mod_ep(self) -> int:
        """Of dp, the ranks that hold the same experts (one per ep group)."""
        return self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same weights and reduce their gradients together: dp x cp."""
        return self.dp * self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``MESH_DIM_NAMES`` order (``CP_MESH_DIM_NAMES`` under context parallelism)."""
        return (self.pp, self.dp, self.cp, self.tp) if self.cp > 1 else (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> RankCoords:
        """The (dp, pp, tp, cp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return RankCoords(dp=dp_rank, pp=pp_rank, tp=tp_rank, cp=cp_rank)

    def named_coords(self, rank: int) -> dict[str, int]:
        """A rank's coordinates by name, as reports show them: cp only where there is context parallelism."""
        named = self.coords(rank)._asdict()
        if self.cp == 1:
            named.pop("cp")
        return named

    def rank(self, coords: RankCoords) -> int:
        """The global rank at given coordinates (inverse of :meth:`coords`)."""
        return coords.tp + self.tp * (coords.cp + self.cp * (coords.dp + self.dp * coords.pp))

    def replica_and_shard(self, rank: int) -> tuple[int, int]:
        """Under HSDP, which replica a rank's dp index is in and its shard index there (dp_rank = replica *
        dp_shard + shard)."""
        return divmod(self.coords(rank).dp, self.dp_shard)

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks that share a ``dim`` ("dp", "pp", "tp", "cp", or under HSDP "dp_replicate" or
        "dp_shard", or under expert parallelism "ep" or "dp_mod_ep") group with ``rank``, in group order."""
        names = MESH_DIM_NAMES + HSDP_MESH_DIM_NAMES[1:3] + ("cp",) + EP_MESH_DIM_NAMES[1:3]
        if dim not in names:
            raise ValueError(f"dim must be one of {names}, got {dim!r}")
        here = self.coords(rank)
        if dim in ("ep", "dp_mod_ep"):
            outer, inner = divmod(here.dp, self.ep)
            dps = ([outer * self.ep + i for i in range(self.ep)] if dim == "ep"
                   else [o * self.ep + inner for o in range(self.dp_mod_ep)])
            return [self.rank(here._replace(dp=dp)) for dp in dps]
        if dim in ("dp_replicate", "dp_shard"):
            replica, shard = self.replica_and_shard(rank)
            dps = ([r * self.dp_shard + shard for r in range(self.dp_replicate)] if dim == "dp_replicate"
                   else [replica * self.dp_shard + s for s in range(self.dp_shard)])
            return [self.rank(here._replace(dp=dp)) for dp in dps]
        return [self.rank(here._replace(**{dim: i})) for i in range(getattr(self, dim))]

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` of this layout; collective: every rank of the world must call it. Under HSDP its
        dims are ``HSDP_MESH_DIM_NAMES`` with "dp" their flattened pair (module doc). Made once per process and
        layout: a later fit of the same layout gets the same mesh (``parallel/group_cache.py``)."""
        from torch.distributed.device_mesh import init_device_mesh

        def make():
            if self.ep > 1:
                mesh = init_device_mesh(device_type, (self.pp, self.dp_mod_ep, self.ep, self.tp),
                                        mesh_dim_names=EP_MESH_DIM_NAMES)
                mesh["dp_mod_ep", "ep"]._flatten("dp")
                return mesh
            if self.cp > 1:
                mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=CP_MESH_DIM_NAMES)
                mesh["dp", "cp"]._flatten("dp_cp")
                return mesh
            if not self.hsdp:
                return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
            mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                    mesh_dim_names=HSDP_MESH_DIM_NAMES)
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            return mesh

        key = ("mesh", device_type, self.pp, self.dp, self.dp_replicate, self.dp_shard, self.tp, self.hsdp, self.cp,
               self.ep)
        return once_per_world(key, make)

    def dp_mesh_for_zero(self, mesh):
        """The mesh ZeRO shards over: "dp" ("dp_cp" under context parallelism), or under HSDP the 2D
        ("dp_replicate", "dp_shard") mesh, on which FSDP2 shards over the second and replicates over the first."""
        return mesh["dp_replicate", "dp_shard"] if self.hsdp else self.replicas_mesh(mesh)

    def replicas_mesh(self, mesh):
        """The (1D) mesh of the ranks that hold the same weights: "dp", or "dp_cp" under context parallelism."""
        return mesh["dp_cp"] if self.cp > 1 else mesh["dp"]

    def __str__(self) -> str:
        hsdp = f" ({self.dp_replicate} replicas x {self.dp_shard} shards)" if self.hsdp else ""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        ep = f" (experts over ep={self.ep} of them)" if self.ep > 1 else ""
        return f"dp={self.dp}{hsdp}{ep} x pp={self.pp}{cp} x tp={self.tp} = {self.world_size} ranks"


def _check_expert_parallel(dims: ParallelDims) -> None:
    """What expert parallelism needs of the other sizes (the experts' own count is checked on the model)."""
    if dims.dp % dims.ep:
        raise ParallelConfigError(
            f"expert_parallel_size={dims.ep} borrows its ranks from the data-parallel ones, but it does not divide"
            f" dp={dims.dp} ({dims.dp * dims.pp * dims.cp * dims.tp} ranks / (pp={dims.pp} x tp={dims.tp}"
            f"{f' x cp={dims.cp}' if dims.cp > 1 else ''})). Choose expert_parallel_size among {divisors(dims.dp)},"
            f" or launch a multiple of {dims.ep * dims.pp * dims.cp * dims.tp} processes.")
    if dims.cp > 1:
        raise ParallelConfigError(
            f"expert_parallel_size={dims.ep} with context_parallel_size={dims.cp} is not supported yet: the experts"
            " would be split over dp x cp. Use one of the two.")
    if dims.dp_shard < dims.dp:
        raise ParallelConfigError(
            f"expert_parallel_size={dims.ep} with data_parallel_shard_size={dims.dp_shard} (HSDP) is not supported"
            " yet. Leave data_parallel_shard_size='auto'.")


def _shard(config: ParallelConfig) -> int:
    """The config's dp shard size, 0 for "auto" (all of dp)."""
    shard = getattr(config, "data_parallel_shard_size", "auto")
    return 0 if shard == "auto" else shard

