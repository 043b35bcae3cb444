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
    """Collects this rank's :class:`Action` s between :meth:`start` and :meth:`stop`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.recording = False
        self.actions: list[Action] = []

    def start(self) -> None:
        self.actions = []
        self.recording = True

    def stop(self) -> list[Action]:
        self.recording = False
        return self.actions

    @contextmanager
    def action(self, stage: int, kind: str, microbatch: int) -> Iterator[None]:
        if not self.recording:
            yield
            return
        if self.device.type == "cuda":  # kernels run asynchronously: time what the device did, not the launch
            torch.cuda.synchronize(self.device)
        start = time.time()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
