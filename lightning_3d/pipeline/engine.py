"""The micro-batch engine: runs the user's unchanged ``training_step`` under a pipeline schedule.

Per step, on the ranks of one pipeline (one pp group):

1. **First stage** -- runs ``training_step(batch)`` once with the pipeline root (the model ``training_step``
   calls, e.g. ``self.model``) replaced by a stub that captures its inputs and stops: those are the inputs
   the schedule cuts into micro-batches. Code in ``training_step`` before the model call therefore runs once
   more than on one device.
2. **Every stage** -- ``torch.distributed.pipelining`` runs its schedule (GPipe, 1F1B, interleaved 1F1B,
   interleaved zero-bubble): forward and backward of each micro-batch, activations sent between stages.
3. **Last stage** -- the schedule's loss function runs ``training_step(micro-batch i)`` with the stub now
   returning stage output ``i``, so the user's own code computes the loss. Its ``self.log`` calls are
   recorded, not sent (a collective there, like ``sync_dist=True``, would hang the other stages).
4. **Every stage** -- the last stage broadcasts the mean loss and the logged values (each averaged over the
   micro-batches) to its pp group; every rank returns that loss and replays those ``self.log`` calls, so
   every rank logs the single-process value and ``sync_dist=True`` is a collective that all ranks join.

The schedule has already run backward, so the strategy skips Lightning's. Evaluation steps use the same path
with forward-only schedules.

**The explicit hook**, for a module whose step cannot be intercepted this way (it calls the model more than
once, or runs code before the call that must not run twice): define both

    def pipeline_inputs(self, batch) -> tuple            # the positional inputs of the pipelined model
    def pipeline_loss(self, output, batch) -> Tensor     # the loss of one micro-batch from the last stage

and the engine calls those instead of ``training_step`` (``validation_step`` / ``test_step`` keep the
interception; ``self.log`` inside ``pipeline_loss`` is handled as above).
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_3d.parallel.config import ParallelConfigError
from lightning_3d.pipeline.as_written import StageForward
from lightning_3d.pipeline.grad_sync import GradSyncStage
from lightning_3d.pipeline.metadata_inference import isolate_metadata_inference
from lightning_3d.pipeline.timeline import PipelineTimeline, TimedPipelineStage

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


class PipelineEngine:
    """Runs one LightningModule step method through a pipeline schedule (see the module docstring)."""

    def __init__(self, *, module: nn.Module, root_name: str, stages: dict[int, nn.Module], num_stages: int,
                 schedule: str, num_microbatches: int, pp_group: dist.ProcessGroup, last_stage_rank: int,
                 device: torch.device, loss_context: Callable[[], Any] = nullcontext,
                 random_state: Callable[[], Any] = nullcontext, stage_output: Callable[[Any], Any] | None = None) -> None:
        self.module = module
        self.root_name = root_name
        self.stages = stages  # stage index -> this rank's module for it
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self.pp_group = pp_group
        self.last_stage_rank = last_stage_rank  # global rank that holds the last stage in this pp group
        self.device = device
        self.loss_context = loss_context  # e.g. vocabulary-parallel loss: around the schedule (fwd and bwd)
        self.random_state = random_state  # restores the random streams after metadata inference
        self.stage_output = stage_output  # the last stage's tensor -> what the user's model call returns
        self.reduce_grads_per_microbatch = False
        """Set before the first step: stages reduce-scatter each block's gradient in every micro-batch, not once
        per step (``pipeline/grad_sync.py``; ``ParallelConfig.pipeline_reduce_grads``)."""
        self._train_stages: list[GradSyncStage] = []
        self._sync_grads = True
        self._schedules: dict[bool, Any] = {}  # train / eval -> schedule (over the same stages)
        self._loss_fns: dict[bool, _CurrentLoss] = {}
        self._step_grads: list[tuple[nn.Parameter, Tensor | None]] = []  # the last training step's, until added
        self._batch_shapes: dict[bool, list[tuple]] = {}  # train / eval -> the first batch's tensor shapes
        self.timeline: PipelineTimeline | None = None
        """Set (by ``PipelineMonitor``) before the first step to build timed stages (``pipeline/timeline.py``)."""
        for index, stage in stages.items():
            if index < num_stages - 1:
                stage.register_forward_hook(_require_tensor_output(index))
        forwards = [stage.forward for stage in stages.values() if isinstance(stage.forward, StageForward)]
        self._as_written_inputs = forwards[0].inputs if forwards else None  # shared by this rank's stages

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    def training_step(self, batch: Any, *args: Any, accumulate_grad_batches: int, sync_grads: bool = True,
                      finish_grads: Callable[[nn.Module], None] | None = None, **step_kwargs: Any) -> Tensor:
        """Lightning's training_step, pipelined. The schedule runs backward now, but Lightning zeroes the
        gradients after training_step and before its backward: this step's gradients are kept aside until
        :meth:`add_step_grads` (called from the strategy's backward), as if computed there.

        ``sync_grads=False`` (an accumulation micro-step) leaves data-parallel stages' gradients unreduced, in
        FSDP2, until a step with True (``pipeline/grad_sync.py``); ``finish_grads`` then waits for that step."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        self._sync_grads = sync_grads  # read by the training stages when the schedule runs (_schedule)
        loss = self.run("training_step", batch, *args, train=True, loss_scale=1.0 / accumulate_grad_batches,
                        **step_kwargs)
        held_in_fsdp = not sync_grads and any(isinstance(m, FSDPModule) for m in self.stages.values())
        if finish_grads is not None and not held_in_fsdp:
            finish_grads(self.module)
        self._step_grads = [(p, p.grad) for p in params]
        for p, grad in zip(params, previous):
            p.grad = grad
        return loss

    def add_step_grads(self) -> None:
        """Add the gradients of the last :meth:`training_step` to the parameters' (accumulated) ones."""
        for param, grad in self._step_grads:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._step_grads = []

    def run(self, method: str, batch: Any, *args: Any, train: bool, loss_scale: float = 1.0,
            **step_kwargs: Any) -> Any:
        """Run ``module.<method>(batch, *args)`` as one pipelined step, on every rank of the pipeline.

        Returns, on every rank: for training, the step's loss (mean over micro-batches); for validation and
        test, the mean of what the step returned if that is a loss (a scalar tensor or a dict with "loss"),
        else None; for ``predict_step``, its outputs concatenated over the micro-batches.
        ``loss_scale`` multiplies the loss the schedule back-propagates (1 / accumulate_grad_batches)."""
        self._check_fixed_shapes(batch, train)
        microbatches = split_batch(batch, self.num_microbatches)
        explicit = train and callable(getattr(self.module, "pipeline_inputs", None))
        if not self.has_first_stage and self._as_written_inputs is None:
            inputs, kwargs = (), {}
        elif explicit:
            inputs, kwargs = tuple(self.module.pipeline_inputs(batch)), {}
        else:
            inputs, kwargs = self._capture_inputs(method, batch, *args, **step_kwargs)
        if self._as_written_inputs is not None:  # every stage rebuilds the model call from the tensors it gets
            self._as_written_inputs.spec = tree_flatten((inputs, kwargs))[1]
            if not self.has_first_stage:
                inputs, kwargs = (), {}
        results: list[Any] = []
        logs: list[list[tuple]] = []

        def loss_fn(output: Tensor, index: Tensor) -> Tensor:
            i = int(index.reshape(-1)[0])
            with self._root_returning(output), self._recording_logs() as recorded:
                if explicit:
                    result = self.module.pipeline_loss(output, microbatches[i])
                else:
                    result = getattr(self.module, method)(microbatches[i], *args, **step_kwargs)
            logs.append(recorded)
            loss = _loss_of(result)
            if train and loss is None:
                raise TypeError(f"{method} must return the loss tensor (or a dict with 'loss') under pipeline"
                                f" parallelism; got {type(result).__name__}")
            results.append(result if method == "predict_step" else loss.detach() if loss is not None else None)
            # Forward-only schedules keep what the loss function returns but never differentiate it.
            return loss * loss_scale if train else torch.zeros(())

        schedule = self._schedule(train, loss_fn)
        targets = torch.arange(self.num_microbatches, device=self.device)
        with self.loss_context():
            if train:
                schedule.step(*inputs, target=targets, return_outputs=False, **kwargs)
            else:
                schedule.eval(*inputs, target=targets, **kwargs)
        return self._share_results(method, results, logs)

    def _check_fixed_shapes(self, batch: Any, train: bool) -> None:
        """A schedule sizes its send/receive buffers at its first step: later batches must have the same
        shapes. Every rank of the pipeline sees the same batch, so all of them raise here, before sending."""
        shapes = [tuple(x.shape) for x in tree_flatten(batch)[0] if isinstance(x, Tensor)]
        first = self._batch_shapes.setdefault(train, shapes)
        if shapes != first:
            raise ValueError(
                f"Under pipeline parallelism every {'training' if train else 'evaluation'} batch must have the"
                f" shapes of the first one, {first}, because the stages exchange fixed-size buffers; this batch"
                f" has {shapes}. Use drop_last=True and a fixed sequence length (pad), or pipeline_parallel_size=1."
            )

    # ------------------------------------------------------------------ the user's step, intercepted

    def _capture_inputs(self, method: str, batch: Any, *args: Any, **step_kwargs: Any) -> tuple[tuple, dict]:
        with _swapped(self.module, self.root_name, _CaptureInputs()), self._recording_logs():
            try:
                getattr(self.module, method)(batch, *args, **step_kwargs)
            except _ModelInputs as captured:
                inputs, kwargs = captured.args, captured.kwargs
            else:
                raise RuntimeError(
                    f"{method} never called self.{self.root_name}(...): under pipeline parallelism the first"
                    " stage takes the inputs of that call. Call the model once per step."
                )
        leaves = tree_flatten((inputs, kwargs))[0]
        if not leaves or not all(isinstance(x, Tensor) for x in leaves):
            raise TypeError(f"self.{self.root_name}(...) must be called with tensors under pipeline parallelism;"
                            f" got {[type(x).__name__ for x in leaves]}")
        return inputs, kwargs

    @contextmanager
    def _root_returning(self, output: Tensor) -> Iterator[None]:
        returned = output if self.stage_output is None else self.stage_output(output)
        with _swapped(self.module, self.root_name, _ReturnOutput(returned)):
            yield

    @contextmanager
    def _recording_logs(self) -> Iterator[list[tuple]]:
        # LightningModule.log has no hook to defer a call; an instance attribute shadows it for the duration.
        recorded: list[tuple] = []
        self.module.log = lambda name, value, *args, **kwargs: recorded.append((name, value, args, kwargs))
        try:
            yield recorded
        finally:
            del self.module.log

    # ------------------------------------------------------------------ results to every rank

    def _share_results(self, method: str, results: list[Any], logs: list[list[tuple]]) -> Any:
        payload = [None]
        if self.has_last_stage:
            if method == "predict_step":
                value = _concatenate(results)
            elif results and all(r is not None for r in results):
                value = float(torch.stack([r.float() for r in results]).mean())
            else:
                value = None
            payload = [{"value": value, "logs": _average_logs(logs)}]
        dist.broadcast_object_list(payload, src=self.last_stage_rank, group=self.pp_group)
        for name, value, args, kwargs in payload[0]["logs"]:
            self.module.log(name, value, *args, **kwargs)
        value = payload[0]["value"]
        if method == "predict_step" or value is None:
            return value
        return torch.tensor(value, device=self.device)

    # ------------------------------------------------------------------ schedules

    def _schedule(self, train: bool, loss_fn: Callable) -> Any:
        key = train
        if key not in self._schedules:
            make_stage = GradSyncStage if self.timeline is None else partial(TimedPipelineStage, timeline=self.timeline)
            stages = [
                make_stage(module, index, self.num_stages, self.device, group=self.pp_group,
                           reduce_per_microbatch=self.reduce_grads_per_microbatch)
                for index, module in sorted(self.stages.items())
            ]
            if train:
                self._train_stages = stages
            for stage in stages:
                isolate_metadata_inference(stage, self.random_state)
            cls = SCHEDULES[self.schedule_name]
            first = stages if self.schedule_name in MULTI_STAGE else stages[0]
            # A training schedule calls its loss function once more the first time it runs, on placeholder
            # outputs, to infer the shapes of the gradients it will send (backward of shape inference).
            self._loss_fns[key] = _CurrentLoss(shape_inference_call=train)
            self._schedules[key] = cls(first, self.num_microbatches, loss_fn=self._loss_fns[key])
        self._loss_fns[key].current = loss_fn
        if train:
            for stage in self._train_stages:
                stage.sync_grads = self._sync_grads
        return self._schedules[key]


def _require_tensor_output(index: int) -> Callable:
    def check(module: nn.Module, args: Any, output: Any) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if not outputs or not all(isinstance(x, Tensor) for x in outputs):
            raise TypeError(
                f"Pipeline stage {index} returned {type(output).__name__}, but the next stage receives tensors"
                " only: the model's forward must pass a tensor (or a tuple of tensors) from block to block."
            )
    return check


class _CurrentLoss:
    """The schedule keeps one loss function for good; each step points it at that step's closure. The
    shape-inference call gets a placeholder loss instead of the user's step (its values are garbage, and
    the user's step must not run -- or log -- on them)."""

    def __init__(self, shape_inference_call: bool) -> None:
        self.current: Callable | None = None
        self._shape_inference_pending = shape_inference_call

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        if self._shape_inference_pending:
            self._shape_inference_pending = False
            local = output.to_local() if isinstance(output, DTensor) else output
            return local.float().sum() * 0.0  # reaches every input, as the real loss does
        return self.current(output, target)


class _ModelInputs(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured the pipeline root's inputs")
        self.args, self.kwargs = args, kwargs


class _CaptureInputs(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _ModelInputs(args, kwargs)


class _ReturnOutput(nn.Module):
    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


@contextmanager
def _swapped(module: nn.Module, fqn: str, stand_in: nn.Module) -> Iterator[None]:
    parent_name, _, name = fqn.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    real = getattr(parent, name)
    setattr(parent, name, stand_in)
    try:
        yield
    finally:
        setattr(parent, name, real)


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """The batch (any pytree) cut into ``num_microbatches`` along dim 0 of every tensor; sizes must divide."""
    leaves, spec = tree_flatten(batch)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    sizes = {x.shape[0] for x in tensors if x.dim() > 0}
    for size in sizes:
        if size % num_microbatches:
            raise ParallelConfigError(
                f"The batch has {size} samples per data-parallel rank, which num_microbatches={num_microbatches}"
                f" does not divide. Choose a batch size per dp rank that is a multiple of {num_microbatches}, or"
                f" another num_microbatches among the divisors of {size}."
            )
    chunks = [torch.tensor_split(x, num_microbatches) if isinstance(x, Tensor) and x.dim() > 0
              else [x] * num_microbatches for x in leaves]
    return [tree_unflatten([chunk[i] for chunk in chunks], spec) for i in range(num_microbatches)]


def _loss_of(result: Any) -> Tensor | None:
    loss = result.get("loss") if isinstance(result, dict) else result
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


def _concatenate(outputs: list[Any]) -> Any:
    """Per-micro-batch outputs as one batch: tensors (also inside lists, tuples, dicts) joined along dim 0."""
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    if any(f[1] != spec for f in flat):
        return outputs
    joined = [torch.cat(leaves) if isinstance(leaves[0], Tensor) and leaves[0].dim() > 0 else list(leaves)
              for leaves in zip(*(f[0] for f in flat))]
    return tree_unflatten(joined, spec)


def _average_logs(per_microbatch: list[list[tuple]]) -> list[tuple]:
    """One ``self.log`` call per name: its value averaged over micro-batches (the mean over the whole batch,
    since micro-batches are the same size), the other arguments from the last call."""
    merged: dict[str, tuple] = {}
    values: dict[str, list[float]] = {}
    for recorded in per_microbatch:
        for name, value, args, kwargs in recorded:
            merged[name] = (name, None, args, kwargs)
            values.setdefault(name, []).append(float(value.detach() if isinstance(value, Tensor) else value))
    return [(name, statistics.fmean(values[name]), args, kwargs) for name, (_, _, args, kwargs) in merged.items()]
