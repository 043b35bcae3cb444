"""Speeds measured on the devices a run will use, for the step-time model (issue 31).

Without a :class:`Calibration` the planner derives every time from datasheet figures (``Cluster``: peak
TFLOP/s times an assumed GEMM efficiency, NVLink and network bandwidth). With one, compute comes from the
measured forward + backward time of one block per token, and each collective from the measured latency and
bandwidth of the link it runs over::

    seconds = latency_s + wire_bytes / bandwidth_bytes_per_s

where ``wire_bytes`` is what each rank sends (:func:`wire_bytes`): NCCL's "bus bytes" convention, so a link
measured with an all-reduce on a group of one size predicts collectives on groups of other sizes.

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
from dataclasses import dataclass
from typing import Any, Mapping

from lightning_3d.errors import PlannerError

DIMENSIONS = ("tp", "pp", "dp")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")


def wire_bytes(collective: str, nbytes: float, ranks: int) -> float:
    """Bytes each rank sends for one ``collective`` of an ``nbytes`` tensor (the whole, gathered or reduced
    tensor) over ``ranks`` ranks, by the ring algorithm: 2 (k - 1) / k of it for an all-reduce, (k - 1) / k
    for an all-gather or reduce-scatter, all of it for a point-to-point send. Zero on one rank."""
    if collective not in COLLECTIVES:
        raise PlannerError(f"collective={collective!r} is not one of {COLLECTIVES}.")
    if ranks <= 1:
        return 0.0
    if collective == "send":
        return float(nbytes)
    share = (ranks - 1) / ranks
    return (2 * share if collective == "all_reduce" else share) * nbytes


@dataclass(frozen=True, kw_only=True)
class LinkSpeed:
    """How long one collective takes on a parallel dimension's group: ``latency_s + wire / bandwidth``.

    Example::

        LinkSpeed.fit(wire=(65536, 4194304), seconds=(80e-6, 2.1e-3))
    """

    latency_s: float
    """Seconds of a collective that moves (almost) nothing: launch, synchronization, the first hop."""
    bandwidth_bytes_per_s: float
    """Wire bytes (:func:`wire_bytes`) per second one rank achieves; ``inf`` for a link that costs nothing."""

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise PlannerError(f"LinkSpeed.latency_s must be a finite number >= 0, got {self.latency_s!r}.")
        if not self.bandwidth_bytes_per_s > 0:
            raise PlannerError(f"LinkSpeed.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}.")

    def seconds(self, wire: float) -> float:
        """Seconds of one collective that puts ``wire`` bytes on the wire per rank (0 when nothing moves)."""
        return self.latency_s + wire / self.bandwidth_bytes_per_s if wire > 0 else 0.0

    @classmethod
    def fit(cls, *, wire: tuple[float, float], seconds: tuple[float, float]) -> "LinkSpeed":
        """The line through two measurements (wire bytes, seconds). A pair that does not rise, as noise gives
        on a fast link, is read as all latency at the larger message's rate."""
        (n1, t1), (n2, t2) = sorted(zip(wire, seconds))
        if t2 > t1 and n2 > n1:
            bandwidth = (n2 - n1) / (t2 - t1)
            return cls(latency_s=max(0.0, t1 - n1 / bandwidth), bandwidth_bytes_per_s=bandwidth)
        return cls(latency_s=max(0.0, t1), bandwidth_bytes_per_s=n2 / max(t2, 1e-12))

    @classmethod
    def of(cls, value: Any) -> "LinkSpeed":
        """A LinkSpeed from another object with ``latency_s`` and ``bandwidth_bytes_per_s``, a dict of them, or
        a ``(latency_s, bandwidth_bytes_per_s)`` pair."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls(latency_s=float(value["latency_s"]), bandwidth_bytes_per_s=float(value["bandwidth_bytes_per_s"]))
        if hasattr(value, "latency_s"):
            return cls(latency_s=float(value.latency_s), bandwidth_bytes_per_s=float(value.bandwidth_bytes_per_s))
        latency, bandwidth = value
        return cls(latency_s=float(latency), bandwidth_bytes_per_s=float(bandwidth))


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Speeds measured on the run's own devices; the planner's step time uses them instead of the cluster's
    datasheet figures (see the module docstring). Plain values only: ``to_dict`` / ``from_dict`` carry it
    through ``broadcast_object_list`` or YAML."""

    block_seconds_per_token: Mapping[int, float]
    """Forward + backward of one whole block (not split over tp), seconds per token, by the micro-batch size
    (sequences) it was timed at; other sizes are interpolated, and clamped to the nearest one timed."""
    head_seconds_per_token: float
    """Forward + backward of the output head and loss (whole vocabulary), seconds per token."""
    tp: LinkSpeed
    """All-reduce, all-gather and reduce-scatter within a tensor-parallel group."""
    pp: LinkSpeed
    """Point-to-point sends between neighbouring pipeline stages."""
    dp: LinkSpeed
    """All-reduce, reduce-scatter and all-gather within a data-parallel group."""
    optimizer_seconds_per_parameter: float | None = None
    """One optimizer step per parameter a rank holds; None: the Adam state streamed at the cluster's memory
    bandwidth."""

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
        if not (self.head_seconds_per_token >= 0 and math.isfinite(self.head_seconds_per_token)):
            raise PlannerError(f"Calibration.head_seconds_per_token must be a finite number >= 0, got"
                               f" {self.head_seconds_per_token!r}.")
        # Frozen: the normalized copies replace what was given (sorted int keys; LinkSpeed from any form).
        object.__setattr__(self, "block_seconds_per_token", dict(sorted(sizes.items())))
        for dim in DIMENSIONS:
            object.__setattr__(self, dim, LinkSpeed.of(getattr(self, dim)))

    def block_seconds(self, micro_batch_size: int) -> float:
        """Seconds per token of one whole block at ``micro_batch_size``: measured, interpolated linearly between
        the sizes around it, or the nearest size's outside the range timed (per-token time flattens as
        micro-batches grow, so extrapolating a trend would overshoot)."""
        sizes = list(self.block_seconds_per_token)
        times = self.block_seconds_per_token
        if micro_batch_size in times:
            return times[micro_batch_size]
        i = bisect.bisect(sizes, micro_batch_size)
        if i == 0:
            return times[sizes[0]]
        if i == len(sizes):
            return times[sizes[-1]]
        lo, hi = sizes[i - 1], sizes[i]
        return times[lo] + (times[hi] - times[lo]) * (micro_batch_size - lo) / (hi - lo)

    def link(self, dimension: str) -> LinkSpeed:
        if dimension not in DIMENSIONS:
            raise PlannerError(f"dimension={dimension!r} is not one of {DIMENSIONS}.")
        return getattr(self, dimension)

    def to_dict(self) -> dict:
        """Plain values (ints, floats, dicts) that :meth:`from_dict` turns back into this calibration."""
        out = {"block_seconds_per_token": dict(self.block_seconds_per_token),
               "head_seconds_per_token": self.head_seconds_per_token,
               "optimizer_seconds_per_parameter": self.optimizer_seconds_per_parameter}
        for dim in DIMENSIONS:
            link = self.link(dim)
            out[dim] = {"latency_s": link.latency_s, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Calibration":
        known = {"block_seconds_per_token", "head_seconds_per_token", "optimizer_seconds_per_parameter", *DIMENSIONS}
        if set(values) - known or {"block_seconds_per_token", "head_seconds_per_token", *DIMENSIONS} - set(values):
            raise PlannerError(f"a Calibration dict has the keys {sorted(known)} (optimizer_seconds_per_parameter"
                               f" optional); got {sorted(values)}.")
        return cls(**values)

    @classmethod
    def from_measurements(cls, block_seconds_per_token: Mapping[int, float], head_seconds_per_token: float,
                          links: Mapping[str, Any], optimizer_seconds_per_parameter: float | None = None
                          ) -> "Calibration":
        """From what the strategy measures: block and head seconds per token, and ``links`` holding "tp", "pp"
        and "dp", each a LinkSpeed, an object with the same two attributes, or a (latency, bandwidth) pair."""
        missing = [dim for dim in DIMENSIONS if dim not in links]
        if missing:
            raise PlannerError(f"links needs a speed for each of {DIMENSIONS}; missing {missing}.")
        return cls(block_seconds_per_token=block_seconds_per_token, head_seconds_per_token=head_seconds_per_token,
                   optimizer_seconds_per_parameter=optimizer_seconds_per_parameter,
                   **{dim: LinkSpeed.of(links[dim]) for dim in DIMENSIONS})
