"""The micro-batch engine: runs the user's unchanged ``training_step`` under a pipeline schedule.

Per step, on the ranks of one pipeline (one pp group):

1. **Every stage** -- runs ``training_step(micro-batch i)`` for each micro-batch with the pipeline root (the
   model ``training_step`` calls, e.g. ``self.model``) replaced by a stand-in that captures its inputs and
   stops: the first stage feeds those inputs to the schedule, the others learn the call's structure. Code in
   ``training_step`` before the model call therefore runs once more than on one device; random draws there
   (token masking) are replayed from the same random state on the last stage (``random_replay.py``).
2. **Every stage** -- ``torch.distributed.pipelining`` runs its schedule (GPipe, 1F1B, interleaved 1F1B,
   interleaved zero-bubble): forward and backward of each micro-batch, activations sent between stages.
3. **Last stage** -- the schedule's loss function runs ``training_step(micro-batch i)`` with the stand-in now
   returning stage output ``i``, so the user's own code computes the loss and updates its metrics. Its
   ``self.log`` calls are recorded, not sent (a collective there, like ``sync_dist=True``, would hang the
   other stages); patterns that cannot run this way (the model called twice, a collective with other
   stages) are found here (``step_checks.py``): the collective check at the first step of each
   schedule, so that the steps after it run no dispatch mode.
4. **Every stage** -- the last stage broadcasts the step's results to its pp group (``shared_results.py``:
   no tensor pickled; the structure only when it changed, so a steady-state step pickles nothing): the
   return value and the
   logged values combined over the micro-batches as one process computes them for the whole batch
   (``step_results.py``: by ``reduce_fx``), and the state its torchmetrics objects gained (``step_metrics.py``).
   Every rank returns that value and replays those ``self.log`` calls, so every rank logs one process's value
   and ``sync_dist=True`` is a collective that all ranks join.

The schedule has already run backward, so the strategy skips Lightning's. Evaluation steps use the same path
with forward-only schedules, one per batch shape (the last, smaller batch of a validation set).

**The explicit hook**, for a module whose step cannot be intercepted this way (it calls the model more than
once, or runs code before the call that must not run twice): define both

    def pipeline_inputs(self, batch) -> tuple            # the positional inputs of the pipelined model
    def pipeline_loss(self, output, batch) -> Tensor     # the loss of one micro-batch from the last stage

and the engine calls those instead of ``training_step`` (``validation_step`` / ``test_step`` keep the
interception; ``self.log`` inside ``pipeline_loss`` is handled as above).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten

from lightning_3d.common import MULTI_STAGE_SCHEDULES
from lightning_3d.pipeline.as_written import StageForward
from lightning_3d.pipeline.grad_sync import GradSyncStage
from lightning_3d.pipeline.metadata_inference import isolate_metadata_inference
from lightning_3d.pipeline.microbatches import concatenate, split_batch
from lightning_3d.pipeline.random_replay import RandomState, replayed
from lightning_3d.pipeline.schedules import SCHEDULES, CurrentLoss, ScheduleGPipe, placeholder_loss
from lightning_3d.pipeline.shared_results import ResultsChannel, host_side
from lightning_3d.pipeline.stand_ins import CaptureInputs, ModelInputs, ReturnOutput, swapped
from lightning_3d.pipeline.step_costs import StepCosts
from lightning_3d.pipeline.step_checks import CollectiveWatch, ModelCalls, StepPatternError, require_tensor_output
from lightning_3d.pipeline.step_metrics import StepMetrics
from lightning_3d.pipeline.step_results import (combine_logs, combine_outputs, detached, loss_of, recording_logs,
                                                replay_logs)
from lightning_3d.pipeline.timeline import PipelineTimeline, TimedPipelineStage


class PipelineEngine:
    """Runs one LightningModule step method through a pipeline schedule (see the module docstring)."""

    def __init__(self, *, module: nn.Module, root_name: str, stages: dict[int, nn.Module], num_stages: int,
                 schedule: str, num_microbatches: int, pp_group: dist.ProcessGroup, last_stage_rank: int,
                 device: torch.device, results_group: dist.ProcessGroup | None = None,
                 loss_context: Callable[[], Any] = nullcontext,
                 random_state: Callable[[], Any] = nullcontext, stage_output: Callable[[Any], Any] | None = None,
                 step_result: Callable[[Any], Any] | None = None,
                 dp_group: dist.ProcessGroup | None = None,
                 finish_grads: Callable[[nn.Module], None] | None = None,
                 reduce_grads_per_microbatch: bool = False,
                 check_inputs: Callable[..., None] | None = None) -> None:
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
        self.step_result = step_result  # what one micro-batch's step returned -> what is kept (whole logits)
        self.finish_grads = finish_grads  # after a step's backward: sums across tp ranks and tied stages
        self.reduce_grads_per_microbatch = reduce_grads_per_microbatch
        """Stages reduce-scatter each block's gradient in every micro-batch, not once per step
        (``pipeline/grad_sync.py``; ``ParallelConfig.pipeline_reduce_grads``)."""
        self.check_inputs = check_inputs
        """Called as ``check_inputs(args, kwargs, model=name)`` with the model call's inputs on every rank of the
        pipeline, before the schedule sends anything (the sequence length under sequence parallelism:
        ``parallel/sequence_length.py``)."""
        self._train_stages: list[GradSyncStage] = []
        self._sync_grads = True
        # (train, batch shapes) -> schedule over the same modules: one for training, one per evaluation shape
        self._schedules: dict[tuple, Any] = {}
        self._loss_fns: dict[tuple, CurrentLoss] = {}
        self._microbatches: dict[tuple, int] = {}  # (train, batch shapes) -> its number of micro-batches
        self._step_grads: list[tuple[nn.Parameter, Tensor | None]] = []  # the last training step's, until added
        self._train_shapes: list[tuple] | None = None  # the first training batch's tensor shapes
        self._index_checked = False  # see _microbatch_index
        self._pp_ranks = dist.get_process_group_ranks(pp_group)
        self._first_stage_rank = self._pp_ranks[0]  # stage 0 is on pp rank 0 (interleaved schedules too)
        self._metrics = StepMetrics(module, dp_group)
        # The step's results travel over a group of their own (the pipeline's ranks), whose receive the other
        # stages post before the step's work (shared_results.ResultsChannel.expect).
        self._results = ResultsChannel(last_stage_rank, results_group or pp_group, device)
        self._watched: set[tuple] = set()  # schedule keys whose first step ran under CollectiveWatch
        self.timeline: PipelineTimeline | None = None  # see record_timeline
        self.costs = StepCosts()
        """Seconds of the last step by part (``costs.seconds``): "capture" (the user's step up to the model call,
        the random state's snapshot and replay), "sharing" (the results, last stage to every rank), "schedule"
        (``torch.distributed.pipelining``: forwards, backwards, waits), "user_loss" (the user's step on the last
        stage's output) and "bookkeeping" (the rest of the engine's own code)."""
        for index, stage in stages.items():
            if index < num_stages - 1:
                stage.register_forward_hook(require_tensor_output(index))
        forwards = [stage.forward for stage in stages.values() if isinstance(stage.forward, StageForward)]
        self._as_written_inputs = forwards[0].inputs if forwards else None  # shared by this rank's stages

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    def record_timeline(self) -> PipelineTimeline:
        """From the next schedule built on: timed stages that record when each action runs, in the returned
        timeline (``pipeline/timeline.py``; ``PipelineMonitor`` asks before the first step)."""
        if self.timeline is None:
            self.timeline = PipelineTimeline(self.device)
        return self.timeline

    def training_step(self, batch: Any, *args: Any, accumulate_grad_batches: int, sync_grads: bool = True,
                      zeroed_after: bool = False, **step_kwargs: Any) -> Tensor:
        """Lightning's training_step, pipelined. The schedule runs backward now, but Lightning zeroes the
        gradients after training_step and before its backward: this step's gradients are kept aside until
        :meth:`add_step_grads` (called from the strategy's backward), as if computed there.

        ``zeroed_after``: Lightning zeroes the gradients after this step (the first batch of an accumulation
        window), so the ones from before it are dropped now rather than held beside this step's: a
        stage's gradients exist once in the step, not twice. Otherwise (accumulating) they are kept and
        this step's are added to them.

        ``sync_grads=False`` (an accumulation micro-step) leaves data-parallel stages' gradients unreduced, in
        FSDP2, until a step with True (``pipeline/grad_sync.py``); ``finish_grads`` then waits for that step.

        Returns what the step returned, combined over the micro-batches (``pipeline/step_results.py``): the
        loss, or the dict with it and the step's other keys."""
        with self.costs.step():
            params = [p for p in self.module.parameters() if p.requires_grad]
            previous = [None if zeroed_after else p.grad for p in params]
            for p in params:
                p.grad = None
            self._sync_grads = sync_grads  # read by the training stages when the schedule runs (_schedule)
            loss = self.run("training_step", batch, *args, train=True, loss_scale=1.0 / accumulate_grad_batches,
                            **step_kwargs)
            held_in_fsdp = not sync_grads and any(isinstance(m, FSDPModule) for m in self.stages.values())
            if self.finish_grads is not None and not held_in_fsdp:
                self.finish_grads(self.module)
            if any(a is not b for a, b in zip(params, (p for p in self.module.parameters() if p.requires_grad))):
                # The gradients went to Parameter objects the module no longer holds (FSDP2 left its gathered ones
                # registered when the step began): the optimizer would step on none of them, silently.
                raise RuntimeError("The module's parameters were replaced during the pipelined step; its gradients"
                                   " would be lost. Please report this with the layout and the Lightning hooks used.")
            self._step_grads = [(p, p.grad) for p in params]
            for p, grad in zip(params, previous):
                p.grad = grad
        return loss

    def add_step_grads(self) -> None:
        """Add the gradients of the last :meth:`training_step` to the parameters' (accumulated) ones."""
        with self.costs.part("bookkeeping"):  # part of the last training step
            for param, grad in self._step_grads:
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
            self._step_grads = []

    def run(self, method: str, batch: Any, *args: Any, train: bool, loss_scale: float = 1.0,
            **step_kwargs: Any) -> Any:
        """Run ``module.<method>(batch, *args)`` as one pipelined step, on every rank of the pipeline.

        Returns, on every rank, what the step returned, combined over the micro-batches: for training the loss
        (or the step's dict with it); for validation and test the same (None if the step returned nothing);
        for ``predict_step``, its outputs concatenated over the micro-batches.
        ``loss_scale`` multiplies the loss the schedule back-propagates (1 / accumulate_grad_batches)."""
        with self.costs.step():
            key, num_microbatches = self._shape_key(batch, train)
            with self.costs.part("sharing"):
                self._results.expect()
            explicit = train and callable(getattr(self.module, "pipeline_inputs", None))
            replay: list[RandomState | None] = [None] * num_microbatches
            with self.costs.part("capture"):
                microbatches = split_batch(batch, num_microbatches)
                if explicit:
                    stage_inputs = (self.has_first_stage or self._as_written_inputs is not None
                                    or self.check_inputs is not None)
                    inputs, kwargs = (tuple(self.module.pipeline_inputs(batch)) if stage_inputs else ()), {}
                else:
                    inputs, kwargs, replay = self._capture_inputs(method, microbatches, *args, **step_kwargs)
            if self.check_inputs is not None:
                self.check_inputs(inputs, kwargs, model=f"self.{self.root_name}")
            if self._as_written_inputs is not None:  # every stage rebuilds the model call from the tensors it gets
                self._as_written_inputs.spec = tree_flatten((inputs, kwargs))[1]
            if not self.has_first_stage:
                inputs, kwargs = (), {}
            results: list[Any] = []
            logs: list[list[tuple]] = []
            errors: list[str] = []
            with self.costs.part("sharing"):
                self._metrics.begin()
            watch = key not in self._watched  # the first step of this schedule: look for collectives (step_checks)
            self._watched.add(key)

            def loss_fn(output: Tensor, index: Tensor) -> Tensor:
                with self.costs.part("bookkeeping"):  # the engine's own code inside "schedule", around the user's
                    i = self._microbatch_index(index)
                    calls = ModelCalls(method, self.root_name)
                    try:
                        with self._root_returning(output, calls), recording_logs(self.module) as recorded, \
                                CollectiveWatch(method, self._pp_ranks) if watch else nullcontext(), \
                                self.costs.part("capture"), replayed(replay[i], self.device), \
                                self.costs.part("user_loss"):
                            if explicit:
                                result = self.module.pipeline_loss(output, microbatches[i])
                            else:
                                result = getattr(self.module, method)(microbatches[i], *args, **step_kwargs)
                    except StepPatternError as found:  # every rank raises it after the schedule (step_checks.py)
                        errors.append(str(found))
                        return placeholder_loss(output)
                    logs.append(recorded)
                    loss = loss_of(result)
                    if train and loss is None:
                        raise TypeError(f"{method} must return the loss tensor (or a dict with 'loss') under"
                                        f" pipeline parallelism; got {type(result).__name__}")
                    with self.costs.part("sharing"):
                        results.append(detached(result if self.step_result is None else self.step_result(result)))
                    # Forward-only schedules keep what the loss function returns but never differentiate it.
                    return loss * loss_scale if train else torch.zeros(())

            schedule = self._schedule(key, num_microbatches, loss_fn)
            targets = torch.arange(num_microbatches, device=self.device)
            with self.loss_context(), self.costs.part("schedule"):
                if train:
                    schedule.step(*inputs, target=targets, return_outputs=False, **kwargs)
                else:
                    # The step's results come from loss_fn; PyTorch's merge of the outputs would also fail on
                    # a scalar among them (a model's own loss, from labels=).
                    schedule.eval(*inputs, target=targets, return_outputs=False, **kwargs)
            with self.costs.part("sharing"):
                return self._share_results(method, results, logs, errors)

    def _microbatch_index(self, target: Tensor) -> int:
        """Which micro-batch the schedule hands the loss function. Its target is its slice of
        ``arange(num_microbatches)``, a view whose offset in the storage is the index: read from the tensor's
        metadata, so no value is copied from the device mid-schedule (a host sync on CUDA). The first call
        checks that against the value, once, in case a torch version ever copies the slices."""
        index = target.storage_offset()
        if not self._index_checked:
            self._index_checked = True
            if index != int(target.reshape(-1)[0]):
                raise RuntimeError("torch.distributed.pipelining no longer hands the loss function views of the"
                                   " target; lightning_3d's engine must read the micro-batch index another way")
        return index

    def _shape_key(self, batch: Any, train: bool) -> tuple[tuple, int]:
        """The schedule for this batch and its number of micro-batches. A schedule sizes its send/receive
        buffers at its first step: training batches must all have the first one's shapes; evaluation gets a
        schedule per batch shape (the last, smaller batch of a validation set), with as many micro-batches as
        divide its size, at most ``num_microbatches``. Every rank of the pipeline sees the same batch, so all
        of them decide alike, before sending anything."""
        shapes = [tuple(x.shape) for x in tree_flatten(batch)[0] if isinstance(x, Tensor)]
        if train:
            self._train_shapes = self._train_shapes or shapes
            if shapes != self._train_shapes:
                raise ValueError(
                    f"Under pipeline parallelism every training batch must have the shapes of the first one,"
                    f" {self._train_shapes}, because the stages exchange fixed-size buffers; this batch has"
                    f" {shapes}. Use drop_last=True and a fixed sequence length (pad), or pipeline_parallel_size=1."
                )
            return (True,), self.num_microbatches
        key = (False, *shapes)
        if key not in self._microbatches:
            size = next((s[0] for s in shapes if s), self.num_microbatches)
            self._microbatches[key] = max(m for m in range(1, self.num_microbatches + 1) if size % m == 0)
        return key, self._microbatches[key]

    # ------------------------------------------------------------------ the user's step, intercepted

    def _capture_inputs(self, method: str, microbatches: list[Any], *args: Any,
                        **step_kwargs: Any) -> tuple[tuple, dict, list[RandomState | None]]:
        """The inputs of the model call, captured per micro-batch on every rank (``pipeline/random_replay.py``).
        If the step draws random numbers before the call, every rank starts from the first stage's random state
        and captures again, keeping the random state each capture started from, for the last stage to replay.
        A step that draws nothing takes two snapshots of the random state and no collective."""
        start = RandomState.now(self.device)
        captured, _ = self._capture_each(method, microbatches, *args, keep_states=False, **step_kwargs)
        if RandomState.now(self.device).same_as(start):  # nothing drawn before the model call
            return (*captured, [None] * len(microbatches))
        # Every rank of the pipeline runs the same step on the same batch, so all of them get here together.
        shared = [start]
        dist.broadcast_object_list(shared, src=self._first_stage_rank, group=self.pp_group,
                                device=host_side(self.pp_group, self.device))
        shared[0].restore(self.device)
        captured, states = self._capture_each(method, microbatches, *args, keep_states=True, **step_kwargs)
        return (*captured, states)

    def _capture_each(self, method: str, microbatches: list[Any], *args: Any, keep_states: bool,
                      **step_kwargs: Any) -> tuple[tuple[tuple, dict], list[RandomState]]:
        per_microbatch, states = [], []
        with swapped(self.module, self.root_name, CaptureInputs(self._root())), recording_logs(self.module):
            for microbatch in microbatches:
                if keep_states:
                    states.append(RandomState.now(self.device))
                try:
                    getattr(self.module, method)(microbatch, *args, **step_kwargs)
                except ModelInputs as captured:
                    per_microbatch.append((captured.args, captured.kwargs))
                else:
                    raise RuntimeError(
                        f"{method} never called self.{self.root_name}(...): under pipeline parallelism the first"
                        " stage takes the inputs of that call. Call the model once per step."
                    )
        leaves = tree_flatten(per_microbatch[0])[0]
        if not leaves or not all(isinstance(x, Tensor) for x in leaves):
            raise TypeError(f"self.{self.root_name}(...) must be called with tensors under pipeline parallelism;"
                            f" got {[type(x).__name__ for x in leaves]}")
        return concatenate(per_microbatch), states

    def _root(self) -> nn.Module:
        return self.module.get_submodule(self.root_name)

    @contextmanager
    def _root_returning(self, output: Tensor, calls: ModelCalls) -> Iterator[None]:
        last = self.stages[self.num_stages - 1]
        if isinstance(last.forward, StageForward):  # the object the model returned, if not tensors
            output = last.forward.model_output(output)
        returned = output if self.stage_output is None else self.stage_output(output)
        with swapped(self.module, self.root_name, ReturnOutput(self._root(), returned, calls)):
            yield

    # ------------------------------------------------------------------ results to every rank

    def _share_results(self, method: str, results: list[Any], logs: list[list[tuple]], errors: list[str]) -> Any:
        payload = None
        if self.has_last_stage:
            payload = {"errors": errors} if errors else {
                "value": concatenate(results) if method == "predict_step" else combine_outputs(results),
                "logs": combine_logs(logs, self._metrics.names(), self.device),
                "metrics": self._metrics.step_states(),
            }
        # Tensors packed on the device; names and numbers pickled on the host when they change (shared_results.py).
        shared = self._results.share(payload)
        if "errors" in shared:
            raise StepPatternError(shared["errors"][0])
        self._metrics.end(shared["metrics"])
        replay_logs(self.module, shared["logs"])
        value = shared["value"]
        if method == "predict_step" or value is None:
            return value
        if isinstance(value, dict):
            return {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in value.items()}
        return value.to(self.device) if isinstance(value, Tensor) else value

    # ------------------------------------------------------------------ schedules

    def _schedule(self, key: tuple, num_microbatches: int, loss_fn: Callable) -> Any:
        train = key[0]
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
            multi = self.schedule_name in MULTI_STAGE_SCHEDULES
            cls = SCHEDULES[self.schedule_name]
            if not train and not multi and num_microbatches < self.num_stages:
                cls = ScheduleGPipe  # forward only, any count (1F1B needs one micro-batch per stage)
            # A training schedule calls its loss function once more the first time it runs, on placeholder
            # outputs, to infer the shapes of the gradients it will send (backward of shape inference).
            self._loss_fns[key] = CurrentLoss(shape_inference_call=train)
            self._schedules[key] = cls(stages if multi else stages[0], num_microbatches, loss_fn=self._loss_fns[key])
        self._loss_fns[key].current = loss_fn
        if train:
            for stage in self._train_stages:
                stage.sync_grads = self._sync_grads
        return self._schedules[key]

