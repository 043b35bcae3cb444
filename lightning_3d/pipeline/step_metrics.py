"""torchmetrics ``Metric`` objects under the pipeline: the state of every micro-batch, on every rank.

One process updates a metric once per batch, in ``training_step`` / ``validation_step`` after the model call.
Under the pipeline that code runs on the last stage, once per micro-batch, so only the last stage's copy of
the metric sees the data, and its ``forward`` value is the last micro-batch's. Yet Lightning computes a
logged metric on every rank (``compute()`` at the end of an epoch, a collective over the metric's process
group) and reports global rank 0's value, and rank 0 holds the first stage. So, per step, on every rank:

1. :meth:`StepMetrics.begin` sets each metric's accumulated state aside and resets it (as torchmetrics'
   own ``forward`` does per batch, here per step);
2. the last stage's micro-batches update it: the state of the whole batch;
3. :meth:`StepMetrics.end` takes that state (received from the last stage on the other ranks), computes the
   batch's value from it alone (what ``forward`` returns for the whole batch in one process) and merges the
   accumulated state back.

Every rank of a pipeline then holds the same state, equal to one process's over the same data; each metric
syncs over the data-parallel group only (``process_group``), where every rank holds other samples.

torchmetrics has no public way to compute a metric without syncing it or to merge a state into a metric
that counts updates; this mirrors what its ``Metric.forward`` does with the same private fields
(``_update_count``, ``_to_sync``, ``_forward_cache``, ``_computed``, torchmetrics 1.x).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torchmetrics import Metric


class StepMetrics:
    """The Metric objects of one LightningModule, kept per step as described in the module doc."""

    def __init__(self, module: nn.Module, dp_group: dist.ProcessGroup | None) -> None:
        self.metrics = {name: m for name, m in module.named_modules() if isinstance(m, Metric)}
        for metric in self.metrics.values():
            if metric.process_group is None and dp_group is not None:
                # The default (every rank) would count a batch once per tensor- and pipeline-parallel rank.
                metric.process_group = dp_group
        self._carried: dict[str, tuple] = {}

    def names(self) -> dict[int, str]:
        return {id(m): name for name, m in self.metrics.items()}

    def begin(self) -> None:
        """Before the step's micro-batches: set each metric's accumulated state aside, start it empty."""
        self._carried = {name: (m._copy_state_dict(), m._update_count, m._forward_cache)
                         for name, m in self.metrics.items()}
        for metric in self.metrics.values():
            metric.reset()

    def step_states(self) -> dict[str, tuple]:
        """On the last stage, after the micro-batches: the states of the metrics the step updated."""
        return {name: (m.metric_state, m._update_count, m._forward_cache is not None)
                for name, m in self.metrics.items() if m._update_count}

    def end(self, step_states: dict[str, tuple]) -> None:
        """On every rank: the step's state (``step_states``, the last stage's) merged into the carried one."""
        for name, metric in self.metrics.items():
            carried, count, forward_cache = self._carried[name]
            if name not in step_states:  # not updated in this step: as it was
                for attr, value in carried.items():
                    setattr(metric, attr, value)
                metric._update_count, metric._forward_cache, metric._computed = count, forward_cache, None
                continue
            state, step_count, forwarded = step_states[name]
            for attr, value in state.items():
                setattr(metric, attr, value)
            metric._update_count = step_count
            batch_value = _computed_locally(metric) if forwarded else None
            metric._update_count = count + step_count
            metric._reduce_states(carried)
            metric._forward_cache, metric._computed = batch_value, None
        self._carried = {}


def _computed_locally(metric: Metric) -> Any:
    """The metric's value from this rank's state alone (no sync), as ``Metric.forward`` computes a batch's."""
    to_sync = metric._to_sync
    metric._to_sync, metric._computed = False, None
    try:
        return metric.compute()
    finally:
        metric._to_sync, metric._computed = to_sync, None
