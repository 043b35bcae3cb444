"""The Trainer that runs a case, in one process or on every rank of a launch, and the callback that records
its per-step losses and gradient norms."""

from __future__ import annotations

import lightning as L
import torch

from helpers.harness.cases import Case
from lightning_3d.callbacks import ExpertLoadMonitor, GradNormMonitor, ThroughputMonitor


class LossRecorder(L.Callback):
    """The loss of each optimizer step, averaged over every rank (so over dp) and over accumulation."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.grad_norms: list[float] = []
        self.expert_loads: list[dict[str, float]] = []
        """Per training batch: what ExpertLoadMonitor logged (mixture-of-experts models)."""
        self._pending: list[torch.Tensor] = []
        self._pending_logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._pending.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean"))
        self._pending_logged.append(float(trainer.callback_metrics["train_loss"]))
        self.expert_loads.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("expert_load/")})
        if len(self._pending) == trainer.accumulate_grad_batches:
            self.grad_norms.append(float(trainer.callback_metrics["grad_norm/global"]))
            self.losses.append(torch.stack(self._pending).mean().item())
            self.logged.append(sum(self._pending_logged) / len(self._pending_logged))
            self._pending, self._pending_logged = [], []


def model_parameters(trainer: L.Trainer) -> int:
    """The whole model's parameter count, as the trainer's ThroughputMonitor counted it."""
    return next(c.model_parameters for c in trainer.callbacks if isinstance(c, ThroughputMonitor))


def trainer_for(case: Case, strategy, devices: int, recorder: LossRecorder) -> L.Trainer:
    """The same Trainer for the reference and every layout; only the strategy and the device count differ."""
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=case.steps,
        accumulate_grad_batches=case.accumulate_grad_batches,
        gradient_clip_val=case.gradient_clip_val,
        gradient_clip_algorithm=case.gradient_clip_algorithm,
        precision=case.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # Lightning's sanity check (its default 2 batches) before training, as a user's run has it: an evaluation
        # step that changes what the next training step computes (FSDP2 left its gathered parameters registered
        # after a forward-only pipeline step, and dp x pp lost the first step's update) shows in every case.
        num_sanity_val_steps=case.sanity_steps,
        limit_val_batches=2,
        callbacks=[GradNormMonitor(every_n_steps=1), ThroughputMonitor(every_n_steps=2), ExpertLoadMonitor(every_n_steps=1), recorder],
    )
