"""One candidate layout: the sizes and settings the planner weighs, convertible to a ParallelConfig."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.errors import PlannerError
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.dims import ParallelDims


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A way to run one optimizer step: ``dp * cp * tp * pp`` ranks, each data-parallel replica taking
    ``num_microbatches`` micro-batches of ``micro_batch_size`` sequences, each sequence split over ``cp``
    ranks through the blocks.

    Construction validates the settings as :class:`~lightning_3d.parallel.config.ParallelConfig` does (same
    errors), so a plan never names a layout the strategy would refuse.

    Example::

        Layout(dp=2, tp=2, pp=2, micro_batch_size=2, num_microbatches=8, zero_stage=1)
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context parallel: the ranks each sequence's blocks run on, a part each (``context_parallel_size``)."""
    ep: int = 1
    """Expert parallel: of the dp ranks, groups of ``ep`` split each block's experts among themselves
    (``expert_parallel_size``); the experts are then data-parallel over dp / ep."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (b)."""
    num_microbatches: int = 1
    """Micro-batches per step and replica (m): the pipeline's, or gradient accumulation with pp = 1."""
    schedule: str = "1f1b"
    """Pipeline schedule (``ParallelConfig.pipeline_schedule``); ignored with pp = 1."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (v); above 1 with the interleaved schedules."""
    sequence_parallel: bool = False
    zero_stage: int = 0
    recompute: str | None = None
    """Activation checkpointing: None, "selective" (every second block, as lightning-3d does it) or "full"."""
    pipeline_reduce_grads: str = "per_step"
    """ZeRO under the pipeline: reduce-scatter once per step or per micro-batch (``ParallelConfig``'s field)."""
    dp_shard: int = 0
    """HSDP: ZeRO shards over groups of this many dp ranks and replicates across the dp / dp_shard groups
    (``ParallelConfig.data_parallel_shard_size``); 0: over all of dp."""

    def __post_init__(self) -> None:
        # raises ParallelConfigError with the strategy's own message
        ParallelDims.from_config(self.to_parallel_config(), self.world_size)
        if self.micro_batch_size < 1 or self.num_microbatches < 1:
            raise PlannerError(f"micro_batch_size ({self.micro_batch_size}) and num_microbatches"
                               f" ({self.num_microbatches}) must be positive.")

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights, over which gradients are averaged: dp x cp."""
        return self.dp * self.cp

    @property
    def shard(self) -> int:
        """The ranks ZeRO shards over: ``dp_shard``, or all of dp x cp."""
        return self.dp_shard or self.dp_cp

    @property
    def replicas(self) -> int:
        """Copies of the ZeRO-sharded model across dp (HSDP); 1 without HSDP."""
        return self.dp_cp // self.shard

    @property
    def expert_shard(self) -> int:
        """The ranks ZeRO shards the experts over: those that hold the same experts, dp / ep."""
        return self.shard // self.ep

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch_size

    def to_parallel_config(self) -> ParallelConfig:
        """The strategy settings of this layout (what ``ThreeDStrategy`` takes)."""
        pipelined = self.pp > 1
        return ParallelConfig(
            tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp, data_parallel_size=self.dp,
            context_parallel_size=self.cp, expert_parallel_size=self.ep,
            pipeline_schedule=self.schedule if pipelined else "1f1b",
            num_microbatches=self.num_microbatches if pipelined else None,
            virtual_pipeline_size=self.virtual_stages, sequence_parallel=self.sequence_parallel,
            zero_stage=self.zero_stage, activation_checkpointing=self.recompute,
            pipeline_reduce_grads=self.pipeline_reduce_grads,
            data_parallel_shard_size=self.dp_shard if self.dp_shard and self.dp_shard < self.dp else "auto")

    def describe(self) -> str:
        """A short name: ``dp2 tp2 pp2 1f1b m8 b2 sp z1 ac=selective``; under HSDP ``dp8(2x4)`` (replicas x
        shards); with expert parallelism ``ep4``, with context parallelism ``cp4``, after dp."""
        hsdp = f"({self.replicas}x{self.shard})" if self.replicas > 1 else ""
        parts = [f"dp{self.dp}{hsdp}", *([f"ep{self.ep}"] if self.ep > 1 else []),
                 *([f"cp{self.cp}"] if self.cp > 1 else []), f"tp{self.tp}", f"pp{self.pp}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else ""))
        parts += [f"m{self.num_microbatches}", f"b{self.micro_batch_size}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero_stage:
            parts.append(f"z{self.zero_stage}" + ("(rs/mb)" if self.pipeline_reduce_grads == "per_microbatch" else ""))
        if self.recompute:
            parts.append(f"ac={self.recompute}")
        return " ".join(parts)
