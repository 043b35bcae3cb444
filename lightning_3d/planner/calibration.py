"""Speeds measured on the devices a run will use, for the step-time model.

Without a :class:`Calibration` the planner derives every time from datasheet figures (``Cluster``: peak
TFLOP/s times an assumed GEMM efficiency, NVLink and network bandwidth). With one, compute comes from the
measured forward + backward time of one block per token, and each collective from the measured latency and
bandwidth of the link it runs over, by the ring algorithm's cost (``planner/links.py``).

Example::

    calibration = Calibration(
        block_seconds_per_token={1: 2.0e-6, 4: 1.6e-6},      # one whole block, forward + backward
        head_seconds_per_token=1.0e-6,
        tp=LinkSpeed(latency_s=20e-6, bandwidth_bytes_per_s=100e9),
        pp=LinkSpeed(latency_s=30e-6, bandwidth_bytes_per_s=20e9),
        dp=LinkSpeed(latency_s=50e-6, bandwidth_bytes_per_s=20e9))
    plan(model, Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=4 * 2**30), global_batch_size=32,
         calibration=calibration)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_3d.errors import PlannerError
from lightning_3d.planner.links import DIMENSIONS, LinkSpeed, plain_speed

SEPARATELY_TIMED = tuple(f"{dim}.{collective}" for dim in ("tp", "dp")
                         for collective in ("all_gather", "reduce_scatter"))
"""The keys of :attr:`Calibration.collective_links`: the collectives ZeRO (dp) and sequence parallelism (tp)
make, timed on their groups apart from the all-reduce."""
OPTIONAL_FIGURES = ("recompute_share", "ddp_sync_seconds_per_byte", "optimizer_seconds_per_embedding_parameter",
                    "zero2_sync_seconds_per_byte", "zero3_sync_seconds_per_byte",
                    "optimizer_dtensor_seconds_per_sharded_block")
"""The calibration's single figures that may be None (not measured: the planner models them instead)."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Speeds measured on the run's own devices; the planner's step time uses them instead of the cluster's
    datasheet figures (see the module docstring). Plain values only: ``to_dict`` / ``from_dict`` carry it
    through ``broadcast_object_list`` or YAML."""

    block_seconds_per_token: Mapping[int, float]
    """Forward + backward of one whole block (not split over tp), seconds per token, by the micro-batch size
    (sequences) it was timed at; other sizes are interpolated, and clamped to the nearest one timed. Kept
    non-increasing in the size (:func:`_non_increasing`): a size timed cheaper per token than a larger one
    takes the larger one's time."""
    head_seconds_per_token: float
    """Forward + backward of the output head and loss (whole vocabulary), seconds per token."""
    tp: LinkSpeed
    """All-reduce within a tensor-parallel group; all-gather and reduce-scatter too, unless timed apart
    (:attr:`collective_links`)."""
    pp: LinkSpeed
    """Point-to-point sends between neighbouring pipeline stages."""
    dp: LinkSpeed
    """All-reduce within a data-parallel group; reduce-scatter and all-gather too, unless timed apart
    (:attr:`collective_links`)."""
    optimizer_seconds_per_parameter: float | None = None
    """One optimizer step per parameter a rank holds in its blocks (timed on one block's); None: the Adam state
    streamed at the cluster's memory bandwidth."""
    optimizer_seconds_per_embedding_parameter: float | None = None
    """As ``optimizer_seconds_per_parameter``, for the parameters outside the blocks (embeddings, final norm,
    head): a few large tensors, timed on one of the embedding's shape. A block's many small tensors cost per
    tensor as much as per number, which does not carry over to these: on 8 gloo ranks sharing 2 cores, 4.6e-8 s
    per parameter on a 64-wide block's against ~1e-8 on an 8192 x 64 embedding. None: the blocks' figure."""
    host_cores_per_rank: float | None = None
    """The host's cores over its ranks' compute threads, where ranks share a host's cores (CPU ranks); None
    where each rank has its own device (GPUs). The block times are measured with every rank computing at once.
    Below 1 the ranks outnumber the cores: a pipeline stage idle in its bubble leaves its core time to the busy
    ones, which then run up to 1 / this faster. At 1 or below no core is left for gloo's collectives to run
    beside compute, so the data-parallel reduction is all exposed, none hidden behind backward."""
    pipeline_microbatch_s: float = 0.0
    """What a pipeline stage spends per micro-batch beyond its compute and its sends: the schedule's own work
    (``torch.distributed.pipelining``'s forward and backward of a chunk, receive buffers, waits and wake-ups),
    measured with a two-stage schedule on the real pipeline pairs. Paid per micro-batch and model chunk."""
    optimizer_dtensor_seconds_per_block: float = 0.0
    """What one optimizer step over one block's parameters costs more where they are DTensors (tensor parallel;
    FSDP2 under a pipeline or ZeRO) than as plain tensors: DTensor's dispatch, per tensor of each multi-tensor
    op, and more on more numbers: timed on replicated parameters (each rank holding all of a block's numbers).
    Paid per block and for the rest of the stage (counted as one more)."""
    optimizer_dtensor_seconds_per_sharded_block: float | None = None
    """As :attr:`optimizer_dtensor_seconds_per_block`, timed on FSDP2's local shards over the world (1 / world of
    each tensor's numbers). Where measured, a rank holding a share f of its blocks' numbers (1 / tp, / the
    ZeRO shard group) pays between the two, linearly in f. None: the replicated figure."""
    tp_head_seconds_per_token: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    """Forward + backward of the output head and loss split over the vocabulary on tp ranks, as the run splits
    them (column-parallel matmul, vocabulary-parallel cross-entropy, their collectives), seconds per token of
    the micro-batch: ``{tp: {micro-batch size: seconds}}``, as ``tp_block_seconds_per_token``. Where a tp size
    is timed, the step time takes it instead of the whole head's time / tp (what the split adds beyond an even
    split counts as tensor-parallel communication, as for the blocks). Its cost is mostly per call (DTensor's
    dispatch, the loss's all-reduces), so a size's is interpolated between the sizes timed, never scaled from
    one of them by tokens."""
    fsdp_block_call_s: float = 0.0
    """What FSDP2's wrapping adds to one forward + backward of a block (its hooks, its parameters' copies in and
    out of their DTensors), whatever the tokens: paid per block and micro-batch, and once more for the rest of
    the stage, where data parallelism wraps each block with FSDP2 (under a pipeline, tensor parallelism or
    ZeRO; not DistributedDataParallel's plain data parallelism)."""
    recompute_share: float | None = None
    """What recomputing a block's forward in its backward (activation checkpointing) adds to the block's forward
    + backward, as a share of it: measured, the block checkpointed against the block alone, in pairs; None: a
    third, a forward's FLOPs of forward + backward's."""
    zero_bubble_split_seconds_per_token: Mapping[int, float] = field(default_factory=dict)
    """What zero bubble's split backward (the input's gradient, then the weights' apart) adds to a block's
    forward + backward, seconds per token by micro-batch size (``{micro-batch size: seconds}``): measured, the
    block's backward split as ``torch.distributed.pipelining`` splits it against whole, in pairs, at the
    smallest and the largest size; other sizes as :meth:`block_seconds`. Empty: nothing. Paid by every block of
    a zero-bubble layout but the first stage's, whose weight gradient torch runs as a whole backward."""
    tp_block_seconds_per_token: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    """Forward + backward of one block split over tp ranks as the run splits it, its collectives included,
    seconds per token of the micro-batch: ``{tp: {micro-batch size: seconds}}``. Where a tp size is timed, the
    step time takes it instead of the whole block's time / tp plus modelled collectives (what the split adds
    beyond an even split counts as tensor-parallel communication)."""
    collective_links: Mapping[str, LinkSpeed] = field(default_factory=dict)
    """All-gather's and reduce-scatter's own speeds on a dimension's group, where they were timed apart from its
    all-reduce: ``{"dp.all_gather": LinkSpeed, "dp.reduce_scatter": ..., "tp.all_gather": ...}``
    (:data:`SEPARATELY_TIMED`). A backend's may differ from what its all-reduce predicts by the ring model:
    on gloo a reduce-scatter runs at a fraction of the all-reduce's bandwidth. A collective not
    timed apart takes its dimension's link (:meth:`link`)."""
    ddp_sync_seconds_per_byte: float | None = None
    """What ``DistributedDataParallel``'s gradient synchronization costs per gradient byte over the world, as it
    runs it (a hook per parameter, an all-reduce per bucket issued from backward, the copies in and out of the
    buckets): measured on the model's own parameter tensors, synchronized against not. Where measured, the
    step time of a layout with data parallelism only (DDP's) takes it instead of the dp link's all-reduce per
    bucket; on 8 gloo ranks sharing 2 cores it is about twice that. None: the link's all-reduce."""
    zero2_sync_seconds_per_byte: float | None = None
    """What FSDP2's ZeRO-2 costs per gradient byte in a step over the world, as it runs it (an all-gather per unit
    before forward, a reduce-scatter per unit from backward, its hooks and copies, each collective's wait for
    the slowest rank): measured on a stand-in of the model's own units, sharded against not. Where measured,
    the step time of a ZeRO layout with data parallelism only takes it instead of the dp link's collectives and
    the per-block FSDP2 figure; on 8 gloo ranks sharing 2 cores it is about twice the links'. None: the links."""
    zero3_sync_seconds_per_byte: float | None = None
    """As :attr:`zero2_sync_seconds_per_byte`, for ZeRO-3 (the parameters gathered again before backward)."""

    def __post_init__(self) -> None:
        sizes = {}
        for size, seconds in dict(self.block_seconds_per_token).items():
            size = int(size)  # keys come back as strings from JSON
            if size < 1 or not (seconds > 0 and math.isfinite(seconds)):
                raise PlannerError(f"Calibration.block_seconds_per_token needs micro-batch sizes >= 1 and finite"
                                   f" times > 0, got {size}: {seconds!r}.")
            sizes[size] = float(seconds)
        if not sizes:
            raise PlannerError("Calibration.block_seconds_per_token is empty: time one block at one micro-batch"
                               " size at least.")
        if self.host_cores_per_rank is not None and not self.host_cores_per_rank > 0:
            raise PlannerError(f"Calibration.host_cores_per_rank must be > 0 or None, got"
                               f" {self.host_cores_per_rank!r}.")
        for name in ("head_seconds_per_token", "pipeline_microbatch_s", "optimizer_dtensor_seconds_per_block",
                     "fsdp_block_call_s", *OPTIONAL_FIGURES):
            value, optional = getattr(self, name), name in OPTIONAL_FIGURES
            if not (optional and value is None) and not (value >= 0 and math.isfinite(value)):
                raise PlannerError(f"Calibration.{name} must be a finite number >= 0{' or None' if optional else ''},"
                                   f" got {value!r}.")
        split = {int(size): float(seconds) for size, seconds in dict(self.zero_bubble_split_seconds_per_token).items()}
        if any(size < 1 or not (seconds >= 0 and math.isfinite(seconds)) for size, seconds in split.items()):
            raise PlannerError(f"Calibration.zero_bubble_split_seconds_per_token needs micro-batch sizes >= 1 and"
                               f" finite times >= 0, got {self.zero_bubble_split_seconds_per_token!r}.")
        object.__setattr__(self, "zero_bubble_split_seconds_per_token", dict(sorted(split.items())))
        # Frozen: the normalized copies replace what was given (sorted int keys; LinkSpeed from any form).
        object.__setattr__(self, "block_seconds_per_token", _non_increasing(sizes))
        for name in ("tp_block_seconds_per_token", "tp_head_seconds_per_token"):
            object.__setattr__(self, name, _by_tp_and_size(name, getattr(self, name)))
        for dim in DIMENSIONS:
            object.__setattr__(self, dim, LinkSpeed.of(getattr(self, dim)))
        unknown = set(self.collective_links) - set(SEPARATELY_TIMED)
        if unknown:
            raise PlannerError(f"Calibration.collective_links takes the keys {SEPARATELY_TIMED};"
                               f" got {sorted(unknown)}.")
        object.__setattr__(self, "collective_links", {key: LinkSpeed.of(speed)
                                                       for key, speed in sorted(self.collective_links.items())})

    def block_seconds(self, micro_batch_size: int) -> float:
        """Seconds per token of one whole block at ``micro_batch_size``: measured; between two sizes timed, the
        call's time interpolated linearly (a fixed cost per call plus a cost per token: the per-token time
        falls as 1/b, not along a line); outside them the nearest size's (per-token time flattens as
        micro-batches grow, so extrapolating a trend would overshoot)."""
        return _interpolated(self.block_seconds_per_token, micro_batch_size)

    def tp_head_seconds(self, micro_batch_size: int, tp: int) -> float | None:
        """Seconds per token of the head and loss split over ``tp`` ranks (interpolated as :meth:`block_seconds`);
        None where that tp size was not timed."""
        times = self.tp_head_seconds_per_token.get(tp)
        return _interpolated(times, micro_batch_size) if times else None

    def tp_block_seconds(self, micro_batch_size: int, tp: int) -> float | None:
        """Seconds per token of one block split over ``tp`` ranks, collectives included (interpolated as
        :meth:`block_seconds`); None where that tp size was not timed."""
        times = self.tp_block_seconds_per_token.get(tp)
        return _interpolated(times, micro_batch_size) if times else None

    def zero_bubble_split_seconds(self, micro_batch_size: int) -> float:
        """Seconds per token zero bubble's split backward adds to a block at ``micro_batch_size`` (0 unmeasured;
        between and beyond the sizes timed as :meth:`block_seconds`)."""
        split = self.zero_bubble_split_seconds_per_token
        return _interpolated(split, micro_batch_size) if split else 0.0

    @property
    def communication_overlaps_compute(self) -> bool:
        """Whether a collective can run beside compute: on a device of its own, or with a core to spare."""
        return self.host_cores_per_rank is None or self.host_cores_per_rank > 1

    def link(self, dimension: str, collective: str = "all_reduce") -> LinkSpeed:
        """The speed ``collective`` runs at on ``dimension``'s group: its own where it was timed apart
        (:attr:`collective_links`), else the dimension's."""
        if dimension not in DIMENSIONS:
            raise PlannerError(f"dimension={dimension!r} is not one of {DIMENSIONS}.")
        return self.collective_links.get(f"{dimension}.{collective}") or getattr(self, dimension)

    def to_dict(self) -> dict:
        """Plain values (ints, floats, dicts) that :meth:`from_dict` turns back into this calibration."""
        out = {"block_seconds_per_token": dict(self.block_seconds_per_token),
               "head_seconds_per_token": self.head_seconds_per_token,
               "optimizer_seconds_per_parameter": self.optimizer_seconds_per_parameter,
               "host_cores_per_rank": self.host_cores_per_rank,
               "pipeline_microbatch_s": self.pipeline_microbatch_s,
               "optimizer_dtensor_seconds_per_block": self.optimizer_dtensor_seconds_per_block,
               "fsdp_block_call_s": self.fsdp_block_call_s,
               **{name: getattr(self, name) for name in OPTIONAL_FIGURES},
               "zero_bubble_split_seconds_per_token": dict(self.zero_bubble_split_seconds_per_token),
               "tp_head_seconds_per_token": {tp: dict(times) for tp, times in self.tp_head_seconds_per_token.items()},
               "tp_block_seconds_per_token": {tp: dict(times) for tp, times in self.tp_block_seconds_per_token.items()}}
        for dim in DIMENSIONS:
            out[dim] = plain_speed(self.link(dim))
        out["collective_links"] = {key: plain_speed(speed) for key, speed in self.collective_links.items()}
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Calibration":
        optional = {"optimizer_seconds_per_parameter", "host_cores_per_rank", "tp_block_seconds_per_token",
                    "pipeline_microbatch_s", "optimizer_dtensor_seconds_per_block", "fsdp_block_call_s",
                    "tp_head_seconds_per_token", "collective_links", "zero_bubble_split_seconds_per_token",
                    *OPTIONAL_FIGURES}
        known = {"block_seconds_per_token", "head_seconds_per_token", *optional, *DIMENSIONS}
        if set(values) - known or known - optional - set(values):
            raise PlannerError(f"a Calibration dict has the keys {sorted(known)} ({', '.join(sorted(optional))}"
                               f" optional); got {sorted(values)}.")
        return cls(**values)

    @classmethod
    def from_measurements(cls, block_seconds_per_token: Mapping[int, float], head_seconds_per_token: float,
                          links: Mapping[str, Any], optimizer_seconds_per_parameter: float | None = None,
                          tp_block_seconds_per_token: Mapping[int, Mapping[int, float]] | None = None,
                          host_cores_per_rank: float | None = None, pipeline_microbatch_s: float = 0.0,
                          optimizer_dtensor_seconds_per_block: float = 0.0,
                          fsdp_block_call_s: float = 0.0,
                          tp_head_seconds_per_token: Mapping[int, Mapping[int, float]] | None = None,
                          recompute_share: float | None = None,
                          ddp_sync_seconds_per_byte: float | None = None,
                          optimizer_seconds_per_embedding_parameter: float | None = None,
                          zero2_sync_seconds_per_byte: float | None = None,
                          zero3_sync_seconds_per_byte: float | None = None,
                          optimizer_dtensor_seconds_per_sharded_block: float | None = None,
                          zero_bubble_split_seconds_per_token: Mapping[int, float] | None = None) -> "Calibration":
        """From what the strategy measures: block and head seconds per token (and the block's under tp, where
        timed), and ``links`` holding "tp", "pp" and "dp", each a LinkSpeed, an object with the same two
        attributes, or a (latency, bandwidth) pair, and any of :data:`SEPARATELY_TIMED` that was timed."""
        missing = [dim for dim in DIMENSIONS if dim not in links]
        if missing:
            raise PlannerError(f"links needs a speed for each of {DIMENSIONS}; missing {missing}.")
        unknown = set(links) - set(DIMENSIONS) - set(SEPARATELY_TIMED)
        if unknown:
            raise PlannerError(f"links takes {DIMENSIONS} and {SEPARATELY_TIMED}; got {sorted(unknown)} besides.")
        return cls(block_seconds_per_token=block_seconds_per_token, head_seconds_per_token=head_seconds_per_token,
                   optimizer_seconds_per_parameter=optimizer_seconds_per_parameter,
                   optimizer_seconds_per_embedding_parameter=optimizer_seconds_per_embedding_parameter,
                   tp_block_seconds_per_token=tp_block_seconds_per_token or {},
                   host_cores_per_rank=host_cores_per_rank, pipeline_microbatch_s=pipeline_microbatch_s,
                   optimizer_dtensor_seconds_per_block=optimizer_dtensor_seconds_per_block,
                   fsdp_block_call_s=fsdp_block_call_s, tp_head_seconds_per_token=tp_head_seconds_per_token or {},
                   recompute_share=recompute_share, ddp_sync_seconds_per_byte=ddp_sync_seconds_per_byte,
                   zero2_sync_seconds_per_byte=zero2_sync_seconds_per_byte,
                   zero3_sync_seconds_per_byte=zero3_sync_seconds_per_byte,
                   optimizer_dtensor_seconds_per_sharded_block=optimizer_dtensor_seconds_per_sharded_block,
                   zero_bubble_split_seconds_per_token=zero_bubble_split_seconds_per_token or {},
                   collective_links={key: links[key] for key in SEPARATELY_TIMED if key in links},
                   **{dim: LinkSpeed.of(links[dim]) for dim in DIMENSIONS})


def _by_tp_and_size(name: str, values: Mapping[Any, Mapping[Any, float]]) -> dict[int, dict[int, float]]:
    """``{tp: {micro-batch size: seconds per token}}`` with int keys (JSON gives strings), sorted, each tp's
    times non-increasing in the size (:func:`_non_increasing`); a tp below 2, an empty entry, a size below 1
    or a time that is not finite and > 0 is refused."""
    result = {}
    for tp, times in dict(values).items():
        timed = {int(b): float(seconds) for b, seconds in dict(times).items()}
        if int(tp) < 2 or not timed or any(b < 1 or not (t > 0 and math.isfinite(t)) for b, t in timed.items()):
            raise PlannerError(f"Calibration.{name} needs tp sizes >= 2, each with micro-batch sizes >= 1 and"
                               f" finite times > 0, got {tp}: {times!r}.")
        result[int(tp)] = _non_increasing(timed)
    return dict(sorted(result.items()))


def _non_increasing(per_token: Mapping[int, float]) -> dict[int, float]:
    """Seconds per token by micro-batch size, sorted, each size's at least any larger size's. A larger
    micro-batch does the same work per token in fewer, larger calls (the same matmuls with more rows, the
    fixed cost of each call spread over more tokens), so a smaller size timed cheaper per token is the timing's
    noise -- ranks sharing cores overlap differently from one repetition to the next -- and choosing it
    for that would pick a layout for a speed it does not have."""
    sizes = sorted(per_token)
    result, floor = {}, 0.0
    for size in reversed(sizes):
        floor = max(floor, per_token[size])
        result[size] = floor
    return dict(sorted(result.items()))


def _interpolated(per_token: Mapping[int, float], size: int) -> float:
    """Seconds per token at micro-batch ``size`` from those timed at other sizes: between two of them the
    call's time (size x per-token) is linear; outside them the nearest size's per-token time."""
    if size in per_token:
        return per_token[size]
    sizes = list(per_token)
    i = bisect.bisect(sizes, size)
    if i == 0:
        return per_token[sizes[0]]
    if i == len(sizes):
        return per_token[sizes[-1]]
    lo, hi = sizes[i - 1], sizes[i]
    call_lo, call_hi = lo * per_token[lo], hi * per_token[hi]
    return (call_lo + (call_hi - call_lo) * (size - lo) / (hi - lo)) / size
