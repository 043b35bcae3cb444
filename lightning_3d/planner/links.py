"""A link's speed, and what one collective moves over it (the ring algorithm's cost: Thakur, Rabenseifner and
Gropp 2005, "Optimization of Collective Communication Operations in MPICH")::

    seconds = steps x latency_s + wire_bytes / bandwidth_bytes_per_s

``steps`` is the ring's sequential hops (:func:`latency_steps`: 2 (k - 1) for an all-reduce over k ranks) and
``wire_bytes`` what each rank sends (:func:`wire_bytes`, NCCL's "bus bytes" convention), so a link measured with
an all-reduce on a group of one size predicts collectives on groups of other sizes. Used by the planner's
:class:`~lightning_3d.planner.calibration.Calibration` and step-time model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from lightning_3d.errors import PlannerError

DIMENSIONS = ("tp", "pp", "dp")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def wire_bytes(collective: str, nbytes: float, ranks: int) -> float:
    """Bytes each rank sends for one ``collective`` of an ``nbytes`` tensor (the whole, gathered or reduced
    tensor) over ``ranks`` ranks, by the ring algorithm: 2 (k - 1) / k of it for an all-reduce, (k - 1) / k
    for an all-gather or reduce-scatter, and for an all-to-all of the tensor a rank sends (its share for each
    other rank), all of it for a point-to-point send. Zero on one rank."""
    if collective not in COLLECTIVES:
        raise PlannerError(f"collective={collective!r} is not one of {COLLECTIVES}.")
    if ranks <= 1:
        return 0.0
    if collective == "send":
        return float(nbytes)
    share = (ranks - 1) / ranks
    return (2 * share if collective == "all_reduce" else share) * nbytes


def latency_steps(collective: str, ranks: int) -> int:
    """Sequential hops of one ``collective`` over ``ranks`` ranks by the ring algorithm, each paying a link's
    latency once: 2 (k - 1) for an all-reduce (a reduce-scatter, then an all-gather), k - 1 for an all-gather,
    reduce-scatter or all-to-all (pairwise exchanges), one for a point-to-point send. Zero on one rank."""
    if collective not in COLLECTIVES:
        raise PlannerError(f"collective={collective!r} is not one of {COLLECTIVES}.")
    if ranks <= 1:
        return 0
    if collective == "send":
        return 1
    return (2 if collective == "all_reduce" else 1) * (ranks - 1)


@dataclass(frozen=True, kw_only=True)
class LinkSpeed:
    """How long one collective takes on a parallel dimension's group: ``steps x latency_s + wire / bandwidth``.

    Example::

        LinkSpeed.fit(wire=(65536, 4194304), seconds=(80e-6, 2.1e-3), steps=14)  # an all-reduce over 8 ranks
    """

    latency_s: float
    """Seconds of one hop of a ring collective that moves (almost) nothing: launch, synchronization, the wake-up
    of the next rank. A collective pays it once per sequential step (:func:`latency_steps`)."""
    bandwidth_bytes_per_s: float
    """Wire bytes (:func:`wire_bytes`) per second one rank achieves; ``inf`` for a link that costs nothing."""

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise PlannerError(f"LinkSpeed.latency_s must be a finite number >= 0, got {self.latency_s!r}.")
        if not self.bandwidth_bytes_per_s > 0:
            raise PlannerError(f"LinkSpeed.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}.")

    def seconds(self, wire: float, steps: int = 1) -> float:
        """Seconds of one collective of ``steps`` sequential hops that puts ``wire`` bytes on the wire per rank
        (0 when nothing moves)."""
        return steps * self.latency_s + wire / self.bandwidth_bytes_per_s if wire > 0 else 0.0

    @classmethod
    def fit(cls, *, wire: tuple[float, float], seconds: tuple[float, float], steps: int = 1) -> "LinkSpeed":
        """The line through two measurements (wire bytes, seconds) of a collective of ``steps`` hops. A pair
        that does not rise, as noise gives on a fast link, is read as all latency at the larger message's rate."""
        (n1, t1), (n2, t2) = sorted(zip(wire, seconds))
        if t2 > t1 and n2 > n1:
            bandwidth = (n2 - n1) / (t2 - t1)
            return cls(latency_s=max(0.0, t1 - n1 / bandwidth) / steps, bandwidth_bytes_per_s=bandwidth)
        return cls(latency_s=max(0.0, t1) / steps, bandwidth_bytes_per_s=n2 / max(t2, 1e-12))

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


def plain_speed(speed: LinkSpeed) -> dict[str, float]:
    """The speed as plain numbers (a calibration's JSON form)."""
    return {"latency_s": speed.latency_s, "bandwidth_bytes_per_s": speed.bandwidth_bytes_per_s}
