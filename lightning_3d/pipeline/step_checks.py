"""Patterns in a user's step that the pipeline cannot run as one process would: found at the first step,
reported by every rank of the pipeline with what was found and what to do -- never a silent wrong result,
never a hang.

The last stage finds them while it runs the step per micro-batch (inside the schedule's loss function, where
raising would leave the other stages waiting for gradients): the check raises :class:`StepPatternError`, the
engine catches it, finishes the schedule on a placeholder loss and hands the error to every rank of the
pipeline with the step's results; every rank then raises it.

* **The model called twice in one step**: the pipeline runs the model once per micro-batch; a second call
  would get the first call's output (:class:`ModelCalls`).
* **A collective inside the step** (``torch.distributed`` or ``self.all_gather``) over a group that holds
  other stages of the pipeline: only the last stage runs the code after the model call, once per
  micro-batch, so the other stages never join it (:class:`CollectiveWatch`). ``self.log(..., sync_dist=True)``
  is not one: the engine replays ``self.log`` on every rank after the step. Collectives within the stage's
  own ranks (a loss over the tensor-parallel group, a metric synced over data-parallel ranks) are allowed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_3d.errors import StepPatternError


class ModelCalls:
    """Counts the calls of the pipeline root in one run of the step; the second one is an error."""

    def __init__(self, method: str, root_name: str) -> None:
        self.method, self.root_name, self.count = method, root_name, 0

    def called(self) -> None:
        self.count += 1
        if self.count > 1:
            raise StepPatternError(
                f"{self.method} called self.{self.root_name}(...) {self.count} times in one step. Under pipeline"
                f" parallelism the model runs once per micro-batch, inside the pipeline schedule, so a second"
                f" call cannot run it again (it would get the first call's output). Call the model once per step"
                f" (concatenate the inputs along the batch dimension), or define pipeline_inputs(batch) and"
                f" pipeline_loss(output, batch) on the LightningModule (the explicit hook, see"
                f" lightning_3d.pipeline.engine), or use pipeline_parallel_size=1."
            )


class CollectiveWatch(TorchDispatchMode):
    """Active while the last stage runs the user's step: a ``c10d`` collective over a group that includes
    another rank of this pipeline (``pp_ranks``) raises :class:`StepPatternError`."""

    def __init__(self, method: str, pp_ranks: list[int]) -> None:
        super().__init__()
        self.method = method
        self.others = set(pp_ranks) - {dist.get_rank()}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d":
            for arg in args:
                group = _process_group(arg)
                if group is not None and self.others & set(dist.get_process_group_ranks(group)):
                    ranks = dist.get_process_group_ranks(group)
                    raise StepPatternError(
                        f"{self.method} runs a collective ({func.overloadpacket.__name__}) over ranks {ranks},"
                        f" which include other stages of this pipeline (ranks {sorted(self.others)}). Under"
                        f" pipeline parallelism only the last stage runs the step's code after the model call,"
                        f" once per micro-batch, so the other stages would never join it. Log values with"
                        f" self.log(..., sync_dist=True) (the engine syncs them on every rank after the step),"
                        f" move the collective to a hook that runs on every rank (on_train_batch_end,"
                        f" on_validation_epoch_end), or use pipeline_parallel_size=1."
                    )
        return func(*args, **(kwargs or {}))


def _process_group(arg: Any) -> dist.ProcessGroup | None:
    if not isinstance(arg, torch.ScriptObject):
        return None
    try:
        return dist.ProcessGroup.unbox(arg)
    except RuntimeError:  # another c10d object (a ReduceOp)
        return None


def require_tensor_output(index: int) -> Callable:
    """A forward hook for stage ``index`` (not the last): the next stage receives tensors only."""
    def check(module: nn.Module, args: Any, output: Any) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if not outputs or not all(isinstance(x, Tensor) for x in outputs):
            raise TypeError(
                f"Pipeline stage {index} returned {type(output).__name__}, but the next stage receives tensors"
                " only: the model's forward must pass a tensor (or a tuple of tensors) from block to block."
            )
    return check
