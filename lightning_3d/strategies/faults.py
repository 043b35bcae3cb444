"""The run's phases under the fault watch: a failing or hanging rank must not stall the job (``lightning_3d.faults``)."""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Callable, Optional

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_3d.faults.flight_recorder import FlightRecorder
from lightning_3d.faults.watch import FaultWatch, Phase

# Strategy arguments that limit a phase: steps are short and regular; set-up and checkpoints scale with the
# model's size and the storage's speed, so they have limits of their own.
TIMEOUTS = ("hang_timeout", "setup_timeout", "checkpoint_timeout")


class RunPhases:
    """Names what this rank is doing -- set-up, a checkpoint's save or load, each step -- each phase limited
    by one of the strategy's ``TIMEOUTS`` (seconds, or None: unlimited), and, once :meth:`start`-ed with the
    process group, has a ``FaultWatch`` end the job when a phase stalls or another rank fails. Before
    ``start`` (and after ``stop``) phases are only names.

    Example (what ``ThreeDStrategy`` does)::

        phases = RunPhases({"hang_timeout": 900.0, "setup_timeout": None, "checkpoint_timeout": None}, 10.0)
        phases.start("gloo", rank, world_size, describe_rank)  # in the set-up phase from here on
        with phases.phase("checkpoint save", "checkpoint_timeout"):
            ...
        phases.step_boundary("training_step started", "training")
    """

    def __init__(self, timeouts: dict[str, Optional[float]], exit_timeout: float) -> None:
        for name, seconds in {**timeouts, "exit_timeout": exit_timeout}.items():
            if seconds is not None and seconds <= 0:
                off = "" if name == "exit_timeout" else " (None turns the hang watchdog off for its phase)"
                raise ValueError(f"{name} ({seconds}) is in seconds and must be positive{off}.")
        self.timeouts = timeouts
        self.exit_timeout = exit_timeout
        """Once a rank raises, every other rank is stopped within this many seconds."""
        self._watch: Optional[FaultWatch] = None

    def start(self, backend: str, rank: int, world_size: int, describe_rank: Callable[[int], str]) -> None:
        """Watch from here on, in the set-up phase; the default process group must exist."""
        # The default group's key-value store is shared by every rank and outlives any collective; PyTorch has
        # no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        # Set-up lasts until the first step: configure_model, sharding and initialization, init_from, the
        # checkpoint restore and the skip to a resume point all come before it.
        recorder = FlightRecorder.of(backend, rank, os.environ)  # None but on NCCL
        self._watch = FaultWatch(store, rank, world_size, describe_rank, self._timed("set-up", "setup_timeout"),
                                 self.exit_timeout, recorder)
        self._watch.start()

    @contextmanager
    def phase(self, name: str, setting: str) -> Generator[None, None, None]:
        """The block is phase ``name``, limited by the strategy argument ``setting`` (one of ``TIMEOUTS``)."""
        if self._watch is None:
            yield
            return
        with self._watch.entered(self._timed(name, setting)):
            yield

    def step_boundary(self, doing: str, phase: str) -> None:
        """From here on (until the next phase) the rank is in ``phase``, under hang_timeout; restarts its clock."""
        if self._watch is not None:
            self._watch.enter(self._timed(phase, "hang_timeout"), doing)

    def announce_failure(self, exception: BaseException) -> None:
        """Tell every other rank that this one raised ``exception``, so none waits for it."""
        # Not a SIGTERM: every rank stops at the same batch (strategies/stop_signal.py), none waits for another.
        if self._watch is not None and not isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            self._watch.announce_failure(exception)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _timed(self, name: str, setting: str) -> Phase:
        return Phase(name, self.timeouts[setting], setting)
