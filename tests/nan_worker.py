"""Run under torchrun (2 ranks, data parallel): rank 1 turns its loss into NaN at step 2 (3 with rollback, so
that a checkpoint of step 2 exists to go back to); NaNGuard must name rank 1 -- not rank 0, whose gradients
only turn NaN in the all-reduce -- and raise, skip or roll back on both ranks.

    python -m torch.distributed.run --nproc-per-node 2 nan_worker.py OUT_DIR ACTION
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from harness import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import NaNGuard
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


class NaNOnRank1(GPTLightningModule):
    """At ``nan_step``, on rank 1 only: the output of block 1 turns NaN (as an overflow would)."""

    def __init__(self, nan_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_step = nan_step

    def configure_model(self):
        super().configure_model()
        self.model.blocks["1"].register_forward_hook(self._poison)

    def _poison(self, module, args, output):
        if self.global_rank == 1 and self.trainer.global_step == self.nan_step:
            return output * float("nan")
        return output


class AfterGuard(L.Callback):
    """What the weights and learning rate are right after the guard acted, at the step it acted on."""

    def __init__(self, step: int) -> None:
        self.step, self.checksum, self.lr = step, None, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            self.checksum = _checksum(pl_module)
            self.lr = optimizer.param_groups[0]["lr"]


def _checksum(module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def main(out_dir: str, action: str) -> None:
    L.seed_everything(0, verbose=False)
    nan_step = 3 if action == "rollback" else 2
    guard = NaNGuard(action=action, check_activations=True, rollback_lr_factor=0.5)
    after = AfterGuard(nan_step)
    callbacks = [guard, after]
    if action == "rollback":
        callbacks.append(ModelCheckpoint(dirpath=Path(out_dir) / "checkpoints", every_n_train_steps=2, save_top_k=-1))
    module = NaNOnRank1(nan_step, config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16), warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ThreeDStrategy(), max_steps=5, logger=False,
                        enable_checkpointing=action == "rollback", enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)
    error = None
    try:
        trainer.fit(module, SyntheticDataModule(seq_len=16, batch_size=4))
    except FloatingPointError as err:
        error = str(err)
    params = [p.detach() for p in module.parameters()]
    result = {"error": error, "skipped": guard.skipped_steps, "steps": trainer.global_step,
              "rollbacks": guard.rollbacks, "after_checksum": after.checksum, "after_lr": after.lr,
              "base_lr": module.hparams.learning_rate,
              "finite": all(bool(torch.isfinite(p).all()) for p in params), "checksum": _checksum(module)}
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
