"""NaNGuard: find where a NaN/Inf came from (rank, coordinates, parameter); raise, skip the step, or roll back."""

from __future__ import annotations

import os
from dataclasses import dataclass

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._pytree import tree_flatten

from lightning_3d.callbacks.grad_checks import GradientChecks, first_not_finite
from lightning_3d.callbacks.layout import dims_of, pipeline_engine
from lightning_3d.common import local

ACTIONS = ("raise", "skip", "rollback")


class NaNGuard(L.Callback):
    """Checks every gradient as backward produces it -- before any data-parallel reduction spreads it, so the
    rank where a NaN/Inf first appears is known -- and, before the optimizer step, agrees across all ranks
    on the device (one all-reduce of a flag; the reports are gathered only when a rank found one) on what was
    found. Then:

    * ``action="raise"`` (the default): every rank raises the same error naming the step, each offending rank,
      its (dp, pp, tp) coordinates and the first parameter whose gradient was not finite there -- one step
      late: the flag is read on the host before the *next* optimizer step (or before a checkpoint is saved,
      or when training ends), by then long computed, so no step waits for the device. What that costs: the
      step with the NaN/Inf has updated the weights (and a logger may have recorded its metrics); no
      checkpoint holds that update, since a pending flag is read before any is written.
    * ``action="skip"``: every rank drops this step's gradients, so the optimizer step changes nothing, and
      training goes on (``skipped_steps`` lists them). The optimizer step must wait for the answer: one host
      sync per checked step.
    * ``action="rollback"``: every rank reloads the newest checkpoint a ``ModelCheckpoint`` wrote -- weights,
      optimizer and LR-scheduler states -- multiplies the learning rates by ``rollback_lr_factor``, drops this
      step's gradients and goes on. The data loader moves on rather than back: the batches since that
      checkpoint, which led to the NaN, are not replayed (as PaLM did after loss spikes), and ``global_step``
      keeps counting so logs stay monotonic. ``rollbacks`` lists (step, checkpoint). Without any
      ``ModelCheckpoint`` the guard refuses to start; if none has been written yet when a NaN appears, it
      skips the step instead and says so. As with ``"skip"``, one host sync per checked step.

    It checks each gradient on the tensor the module computed with, in every layout: the registered
    parameters under DDP, the unsharded tensors FSDP2 swaps in (ZeRO stages 1-3, and replicated data parallel
    with tp or pp), each pipeline stage's (see :class:`~lightning_3d.callbacks.grad_checks.GradientChecks`).
    A gradient no hook saw (a parameter used outside its module's forward) is still checked, after the
    reduction, with a warning that its rank of origin cannot be told.

    With ``check_activations=True`` it also watches every module's output in forward and names the first
    module whose output was not finite (where a NaN was born rather than where its gradient shows).

    Checking every gradient costs one sum per parameter per backward and a forward pre-hook per module that
    holds parameters, a few percent of a forward and backward; under a pipeline, one sum per gradient per
    step, of what the micro-batches accumulated, right before the stage reduces them (no hook per
    micro-batch, whose Python overhead would grow with the micro-batches).
    ``every_n_steps`` checks less often. A checked step reads one value on the host, the all-reduced flag: with
    ``"raise"`` at the next step, from a copy the device made asynchronously (on CUDA, into pinned memory,
    behind an event); with ``"skip"`` and ``"rollback"`` before its own optimizer step (the rest is read only
    in a step where a rank saw a NaN/Inf).

    Example::

        trainer = L.Trainer(strategy="3d", callbacks=[NaNGuard(action="skip")])
        trainer = L.Trainer(strategy="3d", callbacks=[
            ModelCheckpoint(every_n_train_steps=500, save_last=True),
            NaNGuard(action="rollback", rollback_lr_factor=0.5),
        ])
    """

    def __init__(self, action: str = "raise", every_n_steps: int = 1, check_activations: bool = False,
                 rollback_lr_factor: float = 1.0) -> None:
        if action not in ACTIONS:
            raise ValueError(f"NaNGuard(action={action!r}) is not one of {ACTIONS}.")
        if not 0 < rollback_lr_factor <= 1:
            raise ValueError(f"NaNGuard(rollback_lr_factor={rollback_lr_factor}) must be in (0, 1]: the learning"
                             " rates after a rollback are multiplied by it.")
        self.action = action
        self.rollback_lr_factor = rollback_lr_factor
        self.rollbacks: list[tuple[int, str]] = []
        self.every_n_steps = every_n_steps
        self.check_activations = check_activations
        self.skipped_steps: list[int] = []
        self._activations: list[tuple[str, torch.Tensor]] = []  # (module, its output was finite), forward order
        self._grads: GradientChecks | None = None  # while training
        self._handles: list = []  # the activation checks' hooks
        self._pending: _Findings | None = None  # action="raise": the last checked step's, read at the next step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.action == "rollback" and not _checkpoint_callbacks(trainer):
            raise ValueError("NaNGuard(action='rollback') reloads the newest checkpoint, but the Trainer has no"
                             " ModelCheckpoint callback. Add one (e.g. ModelCheckpoint(every_n_train_steps=500,"
                             " save_last=True)), or use action='skip'.")
        self._grads = GradientChecks(pl_module, at_reduction=_checks_at_reduction(trainer))
        if self.check_activations:
            for name, module in pl_module.named_modules():
                if name:
                    hook = lambda mod, args, out, name=name: self._check_activation(name, out, trainer)  # noqa: E731
                    self._handles.append(module.register_forward_hook(hook))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._act_on_pending(trainer, pl_module)  # the last checked step's (raises if it found one)
        self._remove_hooks()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._pending = None
        self._remove_hooks()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._act_on_pending(trainer, pl_module)  # no checkpoint holds the update of a step not yet judged

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._activations = []
        if self._grads is not None:
            self._grads.remove()
            self._grads = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._grads is not None:
            self._grads.active = trainer.global_step % self.every_n_steps == 0

    def _check_activation(self, name: str, output, trainer: L.Trainer) -> None:
        if not trainer.training or trainer.global_step % self.every_n_steps:
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                # Read on the host only in a step where a gradient was not finite, not per module.
                self._activations.append((name, torch.isfinite(local(tensor).detach()).all()))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self._act_on_pending(trainer, pl_module)  # the previous checked step's, computed by now
        if trainer.global_step % self.every_n_steps:
            return
        findings = self._check(trainer, pl_module)
        if self.action == "raise":  # acted on at the next step: this one does not wait for the device
            self._pending = findings
        else:  # the optimizer step must not take gradients that are not finite: wait for the answer now
            self._act(trainer, pl_module, findings)

    def _check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> _Findings:
        """This step's checks, agreed across ranks on the device; nothing read on the host."""
        names, finite = self._grads.collect(pl_module, trainer.global_step) if self._grads is not None else ([], None)
        late_names, late_finite = self._grads.collect_reduced(pl_module) if self._grads is not None else ([], None)
        activations, self._activations = self._activations, []
        # On the rank's device: a collective of the default group takes device tensors (NCCL serves no other).
        # 2: a gradient was not finite before the reduction; 1: only after it (GradientChecks.collect_reduced).
        flag = torch.zeros(1, dtype=torch.int32, device=trainer.strategy.root_device)
        if finite is not None:
            flag.add_(finite.all().logical_not(), alpha=2)
        if late_finite is not None:
            flag.add_(late_finite.all().logical_not())
        if dist.is_initialized():  # every rank learns whether any rank saw one: they all act alike
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return _Findings(trainer.global_step, _HostCopy(flag), names, finite, late_names, late_finite, activations)

    def _act_on_pending(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        findings, self._pending = self._pending, None
        if findings is not None:
            self._act(trainer, pl_module, findings)

    def _act(self, trainer: L.Trainer, pl_module: L.LightningModule, findings: _Findings) -> None:
        found_at = findings.flag.read()
        if not found_at:
            return
        if found_at >= 2:  # the ranks where it appeared are named, not those it reached through the reduction
            first_bad = first_not_finite(findings.names, findings.finite) if findings.finite is not None else None
        else:
            first_bad = first_not_finite(findings.late_names, findings.late_finite)
            first_bad = first_bad and (f"{first_bad} (seen after the data-parallel reduction, which spreads it to"
                                       " every replica: the rank of origin is not known)")
        mine = (first_bad, _first_bad_activation(findings.activations)) if first_bad else None
        found = [mine]
        if dist.is_initialized():  # only now, in a step where some rank saw one, the reports are gathered
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, mine)
        bad = {rank: seen for rank, seen in enumerate(found) if seen}
        if not bad:
            return
        dims = dims_of(trainer)
        report = "; ".join(
            f"rank {rank} ({_where(dims, rank)}): first at {grad}"
            + (f", first non-finite activation in {activation}" if activation else "")
            for rank, (grad, activation) in sorted(bad.items())
        )
        if self.action == "raise":
            raise FloatingPointError(f"NaN/Inf gradient at step {findings.step} on {report}")
        for param in pl_module.parameters():
            param.grad = None
        checkpoint = _newest_checkpoint(trainer) if self.action == "rollback" else None
        if checkpoint is None:
            self.skipped_steps.append(trainer.global_step)
            why = " (no checkpoint to roll back to yet)" if self.action == "rollback" else ""
            pl_module.print(f"NaNGuard skipped step {trainer.global_step}{why}: NaN/Inf gradient on {report}")
            return
        _roll_back(trainer, checkpoint, self.rollback_lr_factor)
        self.rollbacks.append((trainer.global_step, checkpoint))
        pl_module.print(f"NaNGuard rolled back to {checkpoint} at step {trainer.global_step} (learning rates x"
                        f" {self.rollback_lr_factor}): NaN/Inf gradient on {report}")


class _HostCopy:
    """A device value on its way to the host: on CUDA an asynchronous copy into pinned memory and an event behind
    it, so that reading it later waits for nothing queued after it (``.item()`` would wait for all of it)."""

    def __init__(self, value: torch.Tensor) -> None:
        self._event = None
        if value.device.type == "cuda":
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            value = host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._value = value

    def read(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        return int(self._value.tolist()[0])  # (on another device than CUDA's or the host's: a sync)


@dataclass
class _Findings:
    """One checked step's checks, on the device until :meth:`NaNGuard._act` reads ``flag``."""

    step: int
    flag: _HostCopy
    """The all-reduced flag: 0 all finite, 1 a gradient not finite only after the reduction, 2 before it."""
    names: list[str]
    finite: torch.Tensor | None
    late_names: list[str]
    late_finite: torch.Tensor | None
    activations: list[tuple[str, torch.Tensor]]


def _checks_at_reduction(trainer: L.Trainer) -> bool:
    """Under a pipeline that reduces its gradients once per step, they are looked at once, right before that
    (``GradientChecks(at_reduction=True)``); reduced per micro-batch, each backward's are looked at as made."""
    config = getattr(trainer.strategy, "parallel_config", None)
    return pipeline_engine(trainer) is not None and getattr(config, "pipeline_reduce_grads", "") != "per_microbatch"


def _where(dims, rank: int) -> str:
    """A rank's coordinates, as "dp=1, pp=0, tp=1"; under HSDP its replica and shard too."""
    c = dims.coords(rank)
    hsdp = ""
    if dims.hsdp:
        replica, shard = dims.replica_and_shard(rank)
        hsdp = f" (replica {replica}, shard {shard})"
    return f"dp={c.dp}{hsdp}, pp={c.pp}, tp={c.tp}"


def _first_bad_activation(activations: list[tuple[str, torch.Tensor]]) -> str | None:
    if not activations:
        return None
    return first_not_finite([name for name, _ in activations], torch.stack([ok for _, ok in activations]))


def _checkpoint_callbacks(trainer: L.Trainer) -> list[ModelCheckpoint]:
    return [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]


def _newest_checkpoint(trainer: L.Trainer) -> str | None:
    """The most recently written checkpoint of any ModelCheckpoint (rank 0 decides; every rank gets it)."""
    paths = [p for c in _checkpoint_callbacks(trainer)
             for p in [c.last_model_path, c.best_model_path, *c.best_k_models] if p]
    existing = [p for p in paths if os.path.exists(p)]
    newest = max(existing, key=os.path.getmtime) if existing else None
    return trainer.strategy.broadcast(newest)


def _roll_back(trainer: L.Trainer, path: str, lr_factor: float) -> None:
    """Weights, optimizer and LR-scheduler states from ``path``, through the strategy (any layout it wrote)."""
    strategy = trainer.strategy
    checkpoint = strategy.load_checkpoint(path)
    strategy.load_model_state_dict(checkpoint, strict=True)
    strategy.load_optimizer_state_dict(checkpoint)
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", [])):
        config.scheduler.load_state_dict(state)
    for config in trainer.lr_scheduler_configs:
        if hasattr(config.scheduler, "base_lrs"):
            config.scheduler.base_lrs = [lr * lr_factor for lr in config.scheduler.base_lrs]
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= lr_factor
