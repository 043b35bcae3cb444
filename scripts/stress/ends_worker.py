"""One short run on every rank, for scripts/stress/ends.py: it must end as the KIND says, every time.

    python -m torch.distributed.run --standalone --nproc-per-node 4 ends_worker.py KIND OUT_DIR

KIND: fit | fit_async (a checkpoint at every step, ``async_checkpoint=True``) | validate | raise (global
rank 2 raises in its third training step). Layout: dp=1, pp=2, tp=2 (the README's 3D miniature)."""

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

KIND, OUT = sys.argv[1], Path(sys.argv[2])
STEPS = 3
FAILING_RANK = 2


class Module(GPTLightningModule):
    def training_step(self, batch, batch_idx):
        if KIND == "raise" and self.global_rank == FAILING_RANK and self.global_step == STEPS - 1:
            raise ValueError("injected failure on the last step")
        return super().training_step(batch, batch_idx)


def main() -> None:
    L.seed_everything(0, verbose=False)
    strategy = ThreeDStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, async_checkpoint=KIND == "fit_async",
                              exit_timeout=20)
    callbacks = [ModelCheckpoint(dirpath=OUT / "checkpoints", every_n_train_steps=1,
                                 save_top_k=2, monitor="step", mode="max")] \
        if KIND == "fit_async" else []
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=KIND == "fit_async", callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=2)
    module = Module(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    data = SyntheticDataModule(seq_len=16, batch_size=4)
    if KIND == "validate":
        trainer.validate(module, data)
    else:
        trainer.fit(module, data)
    (OUT / f"rank{trainer.global_rank}.done").touch()


if __name__ == "__main__":
    main()
