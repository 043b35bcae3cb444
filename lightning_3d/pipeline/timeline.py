"""When each forward and backward of each micro-batch ran on this rank: the raw material of a pipeline picture.

The engine builds its stages as :class:`TimedPipelineStage` only when someone (``PipelineMonitor``) has given it
a :class:`PipelineTimeline`; otherwise they are plain ``GradSyncStage`` s and nothing here runs. Every schedule
of ``torch.distributed.pipelining`` drives a stage through the same three methods -- ``forward_one_chunk``,
``backward_one_chunk`` (the whole backward, or only the input gradient under zero-bubble schedules) and
``backward_weight_one_chunk`` -- so timing those three times every schedule.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import torch

from lightning_3d.pipeline.grad_sync import GradSyncStage


class Action(NamedTuple):
    """One call of a stage: ``kind`` is "F" (forward), "B" (backward; input gradient only under zero-bubble
    schedules) or "W" (weight gradient, zero-bubble schedules). Times are wall-clock seconds (``time.time()``),
    comparable across the processes of one machine (across machines as far as their clocks agree)."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


class PipelineTimeline:
    """Collects this rank's :class:`Action` s between :meth:`start` and :meth:`stop`.

    On CUDA an action is a pair of CUDA events recorded on the current stream: they time what the device did,
    not the kernel launches, without stopping the host between actions (a synchronize around each would
    serialise compute with the send/recv streams and show a bubble that is not the real one). The device is
    synchronized twice per recorded step: at :meth:`start`, to tie event times to the wall clock, and at
    :meth:`stop`, to read them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.recording = False
        self.actions: list[Action] = []
        self._cuda = device.type == "cuda"
        self._origin: tuple[float, Any] | None = None  # (wall clock, CUDA event) at start
        self._events: list[tuple[int, str, int, Any, Any]] = []

    def start(self) -> None:
        self.actions, self._events = [], []
        self.recording = True
        if self._cuda:
            torch.cuda.synchronize(self.device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            self._origin = (time.time(), origin)

    def stop(self) -> list[Action]:
        self.recording = False
        if self._cuda and self._origin is not None:
            torch.cuda.synchronize(self.device)
            wall, origin = self._origin
            self.actions = [Action(stage, kind, microbatch, wall + origin.elapsed_time(begin) / 1e3,
                                   wall + origin.elapsed_time(end) / 1e3)
                            for stage, kind, microbatch, begin, end in self._events]
        return self.actions

    @contextmanager
    def action(self, stage: int, kind: str, microbatch: int) -> Iterator[None]:
        if not self.recording:
            yield
        elif self._cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self._events.append((stage, kind, microbatch, begin, end))
        else:
            start = time.time()
            yield
            self.actions.append(Action(stage, kind, microbatch, start, time.time()))


class TimedPipelineStage(GradSyncStage):
    """A ``GradSyncStage`` that reports each forward, backward and weight-gradient call to ``timeline``."""

    def __init__(self, *args: Any, timeline: PipelineTimeline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeline = timeline

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.action(self.stage_index, "F", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.action(self.stage_index, "B", bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.action(self.stage_index, "W", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
