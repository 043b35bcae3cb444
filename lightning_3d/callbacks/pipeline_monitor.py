"""PipelineMonitor: the measured pipeline bubble next to the schedule's theoretical one, and a picture of a step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_3d.callbacks.layout import dims_of, pipeline_engine
from lightning_3d.callbacks.timeline_image import draw_timeline
from lightning_3d.common import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES
from lightning_3d.pipeline.timeline import Action, PipelineTimeline

KINDS = "FBW"
"""An action's kind as a number in the gathered tensor: its index here (forward, backward, weight gradient)."""


def theoretical_bubble(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a pipeline step when every stage takes the same time and communication is free.

    * ``gpipe``, ``1f1b``: ``(pp - 1) / (m + pp - 1)`` -- ``pp - 1`` micro-batch slots of fill and drain;
    * ``interleaved_1f1b``: ``(pp - 1) / (v * m + pp - 1)`` with ``v`` stages per rank (each ``1/v`` as long);
    * ``zero_bubble``: ``(pp - 1) / (3 * v * m + pp - 1)`` -- ZB-H1's bubble (Qi et al., 2023), a third of
      1F1B's when forward, input gradient and weight gradient take equal time; a lower bound, not a forecast.
    """
    if schedule in PIPELINE_SCHEDULES and schedule not in MULTI_STAGE_SCHEDULES:
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (virtual * microbatches + pp - 1)
    if schedule == "zero_bubble":
        return (pp - 1) / (3 * virtual * microbatches + pp - 1)
    raise ValueError(f"no theoretical bubble known for pipeline_schedule={schedule!r}")


def measured_bubble(rows: list[list[Action]]) -> float:
    """``1 - busy / (ranks * span)`` over one pipeline (a row per rank): the share of the step's rank-time that
    no forward or backward ran, from the first action of any rank to the last. Waiting for activations,
    sending them and the engine's own work between actions count as bubble, as they do in a real step -- so
    does the last stage's loss (the user's step on the stage output), which the schedule runs between its
    forward and backward calls."""
    actions = [a for row in rows for a in row]
    if not actions:
        return 0.0
    span = max(a.end for a in actions) - min(a.start for a in actions)
    busy = sum(a.end - a.start for a in actions)
    return 1.0 - busy / (len(rows) * span) if span > 0 else 0.0


def bubble_title(measured: float, theory: float, schedule: str, pp: int, microbatches: int) -> str:
    """The picture's title: e.g. "measured bubble 35% vs theoretical 20% (1f1b, pp=2, m=4)"."""
    return f"measured bubble {measured:.0%} vs theoretical {theory:.0%} ({schedule}, pp={pp}, m={microbatches})"


def chrome_trace(rows_of_rank: dict[int, list[Action]]) -> dict:
    """One recorded step in the Chrome trace-event format (opens in https://ui.perfetto.dev and
    chrome://tracing): an "X" event per action named "F3"/"B3"/"W3" (kind, micro-batch), ``pid`` the global
    rank, ``tid`` the stage, ``ts``/``dur`` in microseconds from the step's first action on any rank."""
    actions = [a for row in rows_of_rank.values() for a in row]
    t0 = min((a.start for a in actions), default=0.0)
    events = []
    for rank, row in sorted(rows_of_rank.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for stage in sorted({a.stage for a in row}):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": stage,
                           "args": {"name": f"stage {stage}"}})
        events += [{"ph": "X", "name": f"{a.kind}{a.microbatch}", "pid": rank, "tid": a.stage,
                    "ts": (a.start - t0) * 1e6, "dur": (a.end - a.start) * 1e6,
                    "args": {"microbatch": a.microbatch}} for a in row]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def gather_actions(actions: list[Action], capacity: int, device: torch.device) -> list[list[Action]]:
    """Every rank's actions (collective over the world): one all-gather of a ``(capacity, 5)`` float64 tensor
    per rank -- (stage, kind, micro-batch, start, end) rows, NaN after the last -- and one host read of them.
    Float64 holds the ``time.time()`` stamps exactly."""
    if len(actions) > capacity:  # cannot happen under torch's schedules; the peers would wait in the all-gather
        raise RuntimeError(f"PipelineMonitor: {len(actions)} actions in one step on this rank, more than the"
                           f" {capacity} it has room for; please report it with the schedule.")
    mine = torch.full((capacity, 5), math.nan, dtype=torch.float64)
    if actions:
        mine[:len(actions)] = torch.tensor([(a.stage, KINDS.index(a.kind), a.microbatch, a.start, a.end)
                                            for a in actions], dtype=torch.float64)
    mine = mine.to(device)  # the default group's backend may serve device tensors only (NCCL)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [[Action(int(stage), KINDS[int(kind)], int(microbatch), start, end)
             for stage, kind, microbatch, start, end in rows if not math.isnan(stage)]
            for rows in torch.stack(every).tolist()]  # the one host read: (world, capacity, 5)


class PipelineMonitor(L.Callback):
    """Every ``every_n_steps`` training batches (default: the Trainer's ``log_every_n_steps``; never the first
    batch, which carries the schedule's one-time set-up) records when each forward and backward of each
    micro-batch ran on every rank, then logs

    * ``pipeline/bubble_measured`` -- the idle share of the step (``measured_bubble``), averaged over the
      run's pipelines (one per (dp, tp) coordinate);
    * ``pipeline/bubble_theory`` -- the schedule's ideal (``theoretical_bubble``), for comparison;
    * ``pipeline/timeline`` -- to a TensorBoard logger, an image of global rank 0's pipeline in that step:
      a row per stage (stage 0 on top), time left to right, forward blue, backward green, weight gradient
      orange (zero-bubble schedules), micro-batches in alternating shades, the bubble white. With matplotlib
      (``pip install lightning-3d[plots]``) it is labelled: "stage s (rank g)" per row, the micro-batch number
      on each bar, ms since the step's start, a legend, and the title "measured bubble X% vs theoretical Y%
      (schedule, pp, m)" (X for the pipeline shown); without matplotlib, the same bars unlabelled;
    * with ``trace_dir``, on global rank 0, ``trace_dir/pipeline_step{global_step}.json`` per recorded step:
      every rank's actions as a Chrome trace (:func:`chrome_trace`; open it in https://ui.perfetto.dev). It
      holds the timed forward/backward/weight-gradient calls only. The send/recv and collectives on their CUDA
      streams are what ``torch.profiler`` would add on a GPU (``torch.profiler.profile`` around a step,
      ``export_chrome_trace``, one file per rank); this callback does not run the profiler.

    The engine builds timed pipeline stages only when this callback is present; the timelines reach rank 0
    through one all-gather of a tensor (:func:`gather_actions`) in which every rank takes part. On CUDA each
    timed action is a pair of CUDA events on the compute stream, read after the step (``pipeline/timeline.py``),
    so the picture shows device time without serialising the schedule. Without pipeline parallelism there is
    nothing to watch: it says so once and does nothing.

    Example::

        strategy = ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=8, pipeline_schedule="1f1b")
        trainer = L.Trainer(strategy=strategy, devices=2, callbacks=[PipelineMonitor()])
        # TensorBoard: pipeline/bubble_measured vs pipeline/bubble_theory (0.11), IMAGES tab: pipeline/timeline
    """

    def __init__(self, every_n_steps: int | None = None, image_width: int = 800,
                 trace_dir: str | Path | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.image_width = image_width
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.last_rows: list[list[Action]] = []
        """Rank 0's pipeline in the last recorded batch: the actions of each stage's rank."""
        self.last_image: torch.Tensor | None = None
        """The picture of ``last_rows`` ((H, W, 3) uint8), on global rank 0."""
        self.bubble_theory: float | None = None
        self.title = ""
        """The picture's title (:func:`bubble_title`) for ``last_rows``."""
        self._schedule: tuple[str, int, int] = ("", 0, 0)  # name, pp, micro-batches: for the title
        self._timeline: PipelineTimeline | None = None
        self._capacity = 0  # the most actions a rank records in a step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = pipeline_engine(trainer)
        if engine is None:
            rank_zero_warn("PipelineMonitor has nothing to watch: the run has no pipeline (it needs ThreeDStrategy"
                           " with pipeline_parallel_size > 1). It logs nothing.")
            return
        dims = dims_of(trainer)
        self.bubble_theory = theoretical_bubble(engine.schedule_name, dims.pp, engine.num_microbatches,
                                                engine.num_stages // dims.pp)
        self._schedule = (engine.schedule_name, dims.pp, engine.num_microbatches)
        self._timeline = engine.record_timeline()
        # Each of a rank's stages runs every micro-batch's forward, backward and (zero-bubble) weight gradient.
        self._capacity = 3 * engine.num_stages // dims.pp * engine.num_microbatches

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if self._timeline is not None and batch_idx > 0 and not batch_idx % every:
            self._timeline.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._timeline is None or not self._timeline.recording:
            return
        every = [self._timeline.stop()]
        if dist.is_initialized():  # every rank recorded the same batch, so every rank is here
            every = gather_actions(every[0], self._capacity, pl_module.device)
        dims = dims_of(trainer)
        pipelines = {tuple(dims.group_ranks("pp", rank)) for rank in range(dims.world_size)}
        bubbles = [measured_bubble([every[r] for r in ranks]) for ranks in pipelines]
        shown = dims.group_ranks("pp", 0)  # global rank 0's pipeline
        self.last_rows = [every[r] for r in shown]
        pl_module.log_dict({"pipeline/bubble_measured": sum(bubbles) / len(bubbles),
                            "pipeline/bubble_theory": self.bubble_theory}, on_step=True, on_epoch=False)
        if trainer.is_global_zero:
            self.title = bubble_title(measured_bubble(self.last_rows), self.bubble_theory, *self._schedule)
            self.last_image = draw_timeline(self.last_rows, self.image_width, shown, self.title)
            if self.trace_dir is not None:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                trace = chrome_trace(dict(enumerate(every)))
                (self.trace_dir / f"pipeline_step{trainer.global_step}.json").write_text(json.dumps(trace))
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_image("pipeline/timeline", self.last_image, trainer.global_step,
                                                dataformats="HWC")
