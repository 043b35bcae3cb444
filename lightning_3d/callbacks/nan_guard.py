"""NaNGuard: find where a NaN/Inf came from (rank, coordinates, parameter) and raise or skip the step."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from lightning_3d.callbacks.layout import dims_of

ACTIONS = ("raise", "skip")


class NaNGuard(L.Callback):
    """Checks every gradient as backward produces it -- before any data-parallel reduction spreads it, so the
    rank where a NaN/Inf first appears is known -- and, before the optimizer step, agrees across all ranks
    (one all-gather) on what was found. Then:

    * ``action="raise"``: every rank raises the same error naming each offending rank, its (dp, pp, tp)
      coordinates and the first parameter whose gradient was not finite there;
    * ``action="skip"``: every rank drops this step's gradients, so the optimizer step changes nothing, and
      training goes on (``skipped_steps`` lists them).

    With ``check_activations=True`` it also watches every module's output in forward and names the first
    module whose output was not finite (where a NaN was born rather than where its gradient shows).

    Checking every gradient costs one reduction per parameter per backward (a device sync on GPU): for large
    runs, check every ``every_n_steps``.

    Example::

        trainer = L.Trainer(strategy="3d", callbacks=[NaNGuard(action="skip")])
    """

    def __init__(self, action: str = "raise", every_n_steps: int = 1, check_activations: bool = False) -> None:
        if action not in ACTIONS:
            hint = " (rollback to the last good checkpoint is not available yet)" if action == "rollback" else ""
            raise ValueError(f"NaNGuard(action={action!r}) is not one of {ACTIONS}{hint}.")
        self.action = action
        self.every_n_steps = every_n_steps
        self.check_activations = check_activations
        self.skipped_steps: list[int] = []
        self._first_bad: str | None = None
        self._first_bad_activation: str | None = None
        self._handles: list = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, param in pl_module.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(lambda grad, name=name: self._check(name, grad, trainer)))
        if self.check_activations:
            for name, module in pl_module.named_modules():
                if name:
                    hook = lambda mod, args, out, name=name: self._check_activation(name, out, trainer)  # noqa: E731
                    self._handles.append(module.register_forward_hook(hook))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check(self, name: str, grad: torch.Tensor, trainer: L.Trainer) -> None:
        if self._first_bad is None and trainer.global_step % self.every_n_steps == 0:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if not bool(torch.isfinite(local).all()):
                self._first_bad = name

    def _check_activation(self, name: str, output, trainer: L.Trainer) -> None:
        if self._first_bad_activation is not None or trainer.global_step % self.every_n_steps:
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if not bool(torch.isfinite(local.detach()).all()):
                    self._first_bad_activation = name
                    return

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        mine = (self._first_bad, self._first_bad_activation) if self._first_bad else None
        self._first_bad = self._first_bad_activation = None
        found = [mine]
        if dist.is_initialized():  # every rank learns what every rank saw: they all act alike
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, mine)
        bad = {rank: seen for rank, seen in enumerate(found) if seen}
        if not bad:
            return
        dims = dims_of(trainer)
        report = "; ".join(
            f"rank {rank} (dp={c.dp}, pp={c.pp}, tp={c.tp}): first at {grad}"
            + (f", first non-finite activation in {activation}" if activation else "")
            for rank, (grad, activation) in sorted(bad.items()) for c in [dims.coords(rank)]
        )
        if self.action == "raise":
            raise FloatingPointError(f"NaN/Inf gradient at step {trainer.global_step} on {report}")
        for param in pl_module.parameters():
            param.grad = None
        self.skipped_steps.append(trainer.global_step)
        pl_module.print(f"NaNGuard skipped step {trainer.global_step}: NaN/Inf gradient on {report}")
