"""Strategy hooks that keep a failing or hanging rank from stalling the job (``lightning_3d.faults``)."""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist
from typing_extensions import override

from lightning_3d.faults.flight_recorder import FlightRecorder
from lightning_3d.faults.watch import FaultWatch, Phase

# Strategy arguments that limit a phase: steps are short and regular; set-up and checkpoints scale with the
# model's size and the storage's speed, so they have limits of their own.
TIMEOUTS = ("hang_timeout", "setup_timeout", "checkpoint_timeout")


class FaultHandling:
    """Mixed into ``ThreeDStrategy``: starts a ``FaultWatch`` once the process group is up (in the set-up
    phase), names the phases after it (checkpoints, steps), publishes an exception raised on this rank, and
    stops watching at teardown. ``_fault_timeouts`` holds the strategy's ``TIMEOUTS`` by name."""

    _fault_watch: Optional[FaultWatch] = None
    _fault_timeouts: dict[str, Optional[float]]

    def _start_fault_watch(self, exit_timeout: float) -> None:
        # The default group's key-value store is shared by every rank and outlives any collective; PyTorch has
        # no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        # Set-up lasts until the first step: configure_model, sharding and initialization, init_from, the
        # checkpoint restore and the skip to a resume point all come before it.
        recorder = FlightRecorder.of(self._process_group_backend, self.global_rank, os.environ)  # None but NCCL
        self._fault_watch = FaultWatch(store, self.global_rank, self.world_size, self._describe_rank,
                                       self._timed_phase("set-up", "setup_timeout"), exit_timeout, recorder)
        self._fault_watch.start()

    def _describe_rank(self, rank: int) -> str:
        c = self.parallel_dims.coords(rank)
        return f"rank {rank} (dp={c.dp}, pp={c.pp}, tp={c.tp})"

    def _timed_phase(self, name: str, setting: str) -> Phase:
        return Phase(name, self._fault_timeouts[setting], setting)

    @contextmanager
    def _phase(self, name: str, setting: str) -> Generator[None, None, None]:
        """The block is phase ``name``, limited by the strategy argument ``setting`` (one of ``TIMEOUTS``)."""
        if self._fault_watch is None:
            yield
            return
        with self._fault_watch.entered(self._timed_phase(name, setting)):
            yield

    def _progress(self, doing: str, phase: str) -> None:
        """A step boundary: from here on (until the next phase) the rank is in ``phase``, under hang_timeout."""
        if self._fault_watch is not None:
            self._fault_watch.enter(self._timed_phase(phase, "hang_timeout"), doing)

    def _stop_fault_watch(self) -> None:
        if self._fault_watch is not None:
            self._fault_watch.stop()
            self._fault_watch = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._fault_watch is not None and not isinstance(exception, KeyboardInterrupt):
            self._fault_watch.announce_failure(exception)
