"""NaNGuard: find where a NaN/Inf came from (rank, coordinates, parameter); raise, skip the step, or roll back."""

from __future__ import annotations

import os

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
    (one all-reduce; the reports are gathered only when a rank found one) on what was found. Then:

    * ``action="raise"``: every rank raises the same error naming each offending rank, its (dp, pp, tp)
      coordinates and the first parameter whose gradient was not finite there;
    * ``action="skip"``: every rank drops this step's gradients, so the optimizer step changes nothing, and
      training goes on (``skipped_steps`` lists them).
    * ``action="rollback"``: every rank reloads the newest checkpoint a ``ModelCheckpoint`` wrote -- weights,
      optimizer and LR-scheduler states -- multiplies the learning rates by ``rollback_lr_factor``, drops this
      step's gradients and goes on. The data loader moves on rather than back: the batches since that
      checkpoint, which led to the NaN, are not replayed (as PaLM did after loss spikes), and ``global_step``
      keeps counting so logs stay monotonic. ``rollbacks`` lists (step, checkpoint). Without any
      ``ModelCheckpoint`` the guard refuses to start; if none has been written yet when a NaN appears, it
      skips the step instead and says so.

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
    ``every_n_steps`` checks less often. A checked step reads the device on the host once: the all-reduced
    flag, before the optimizer step (the rest is read only in a step where a rank saw a NaN/Inf).

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
        if trainer.global_step % self.every_n_steps:
            return
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
        found_at = flag.item()  # the one host sync of a checked step: the optimizer step must wait for the answer
        if not found_at:
            return
        if found_at >= 2:  # the ranks where it appeared are named, not those it reached through the reduction
            first_bad = first_not_finite(names, finite) if finite is not None else None
        else:
            first_bad = first_not_finite(late_names, late_finite)
            first_bad = first_bad and (f"{first_bad} (seen after the data-parallel reduction, which spreads it to"
                                       " every replica: the rank of origin is not known)")
        mine = (first_bad, _first_bad_activation(activations)) if first_bad else None
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
            raise FloatingPointError(f"NaN/Inf gradient at step {trainer.global_step} on {report}")
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
