"""A job that resumes itself: run under ``torchrun --max-restarts=1``; on the first attempt rank 1 is killed
(SIGKILL, as by the OOM killer) at the start of step KILL_AT; torchrun starts the job again and
``fit(ckpt_path="last")`` continues from the newest complete checkpoint.

    python -m torch.distributed.run --max-restarts=1 --nproc-per-node 2 restart_worker.py OUT_DIR

Each rank appends every step's loss, with the attempt number, to OUT_DIR/losses_rank{N}.jsonl.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.harness import Case, module_and_data
from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)
STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class LossLog(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if ATTEMPT == 0 and trainer.global_rank == 1 and trainer.global_step == KILL_AT - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean"))
        with self.path.open("a") as f:
            f.write(json.dumps({"attempt": ATTEMPT, "step": trainer.global_step, "loss": loss}) + "\n")


def main(out_dir: str) -> None:
    out = Path(out_dir)
    module, data = module_and_data(Case(name="restart", model=MODEL, steps=STEPS), 8 // 2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ThreeDStrategy(data_parallel_size=2), max_steps=STEPS,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=SAVE_EVERY, save_last=True),
            LossLog(out / f"losses_rank{os.environ['RANK']}.jsonl"),
        ],
    )
    trainer.fit(module, data, ckpt_path="last")
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
