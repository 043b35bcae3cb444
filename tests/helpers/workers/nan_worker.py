"""Run under torchrun: the ranks of data-parallel replica 1 turn block 1's output into NaN at chosen steps;
NaNGuard must name those ranks -- not replica 0's, whose gradients only turn NaN in the dp reduction -- and
raise, skip or roll back on every rank.

    python -m torch.distributed.run --nproc-per-node 2 nan_worker.py OUT_DIR ACTION
    python -m torch.distributed.run --nproc-per-node 4 nan_worker.py OUT_DIR layouts DP,PP,TP,ZERO[,SHARD][,bf16] ...

With ACTION (2 ranks, DDP): the NaN comes at step 2 (3 with rollback, so that a checkpoint of step 2 exists).
With ``layouts``: one fit per layout, one after another in this launch, each with ``action="rollback"`` and a
checkpoint every 2 steps: the NaN at step 1 comes before any checkpoint, so that step is skipped (the
``action="skip"`` path); the NaN at step 3 rolls back to the checkpoint of step 2.
"""

import contextlib
import io
import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import NaNGuard
from lightning_3d.callbacks.layout import dims_of
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


class NaNOnReplica1(GPTLightningModule):
    """At each of ``nan_steps``, on the ranks of dp replica 1 that hold block 1: its output turns NaN (as an
    overflow would) at its first call of the step -- under a pipeline, the first micro-batch only, whose
    gradients NaNGuard looks at with the stage's last backward, as accumulated (issue 30)."""

    def __init__(self, nan_steps: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_steps = nan_steps

    def configure_model(self):
        super().configure_model()
        self.poison_now = False
        module = self  # a closure, not a bound method: pipeline shape inference runs on a copy of the block

        def poison(block, args, output):
            if not module.poison_now:
                return output
            module.poison_now = False
            return output * float("nan")

        self.model.blocks["1"].register_forward_hook(poison)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        replica = dims_of(self.trainer).coords(self.global_rank).dp
        self.poison_now = replica == 1 and self.trainer.global_step in self.nan_steps


class Weights(L.Callback):
    """This rank's weights (a checksum of its shards) at the start of every step, and right after the guard
    acted at ``step`` (with the learning rate then)."""

    def __init__(self, step: int) -> None:
        self.step, self.after_guard, self.lr = step, None, None
        self.at_start: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.at_start[trainer.global_step] = _checksum(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            self.after_guard = _checksum(pl_module)
            self.lr = optimizer.param_groups[0]["lr"]


def _checksum(module) -> float:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    return float(sum(p.detach().double().sum() for p in local))


def fit(out_dir: Path, action: str, nan_steps: list[int], act_step: int, strategy: ThreeDStrategy,
        precision: str = "32-true") -> dict:
    L.seed_everything(0, verbose=False)
    guard = NaNGuard(action=action, check_activations=True, rollback_lr_factor=0.5)
    weights = Weights(act_step)
    callbacks = [guard, weights]
    if action == "rollback":
        callbacks.append(ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=2, save_top_k=-1))
    module = NaNOnReplica1(nan_steps, config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16),
                           warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=strategy, precision=precision, max_steps=5, logger=False,
                        enable_checkpointing=action == "rollback",
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=callbacks)
    error, printed = None, io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.filterwarnings("always", "NaNGuard")  # recorded; any other warning of ours still fails the rank
        try:
            trainer.fit(module, SyntheticDataModule(seq_len=16, batch_size=4))
        except FloatingPointError as err:
            error = str(err)
    params = [p.detach() for p in module.parameters()]
    return {"error": error, "skipped": guard.skipped_steps, "steps": trainer.global_step,
            "rollbacks": guard.rollbacks, "after_checksum": weights.after_guard, "after_lr": weights.lr,
            "at_start": weights.at_start, "base_lr": module.hparams.learning_rate,
            "finite": all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in params),
            "checksum": _checksum(module), "names": [n for n, _ in module.named_parameters()],
            "printed": [line for line in printed.getvalue().splitlines() if line.startswith("NaNGuard")],
            "warnings": [str(w.message) for w in caught if "NaNGuard" in str(w.message)]}


def main(out_dir: str, action: str, layouts: list[str]) -> None:
    out = Path(out_dir)
    if action != "layouts":
        nan_step = 3 if action == "rollback" else 2
        result = fit(out, action, [nan_step], nan_step, ThreeDStrategy())
    else:
        result = {}
        for layout in layouts:
            dp, pp, tp, zero, *shard = parse_layout(layout)  # shard: HSDP's dp shard size
            strategy = ThreeDStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                      zero_stage=zero, data_parallel_shard_size=shard[0] if shard else "auto")
            precision = "bf16-mixed" if layout.endswith(",bf16") else "32-true"
            result[layout] = fit(out / layout, "rollback", [1, 3], 3, strategy, precision)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_process_group()


def parse_layout(layout: str) -> list[int]:
    """"dp,pp,tp,zero[,shard][,bf16]" -> [dp, pp, tp, zero(, shard)]; a trailing "bf16" runs it under bf16-mixed."""
    return [int(x) for x in layout.split(",") if x != "bf16"]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
