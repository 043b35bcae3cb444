"""One rank fails or hangs on purpose; the fault watch (lightning_3d.faults) must take the job down.

    python -m torch.distributed.run --standalone --nproc-per-node N faults_worker.py OUT_DIR WHERE RANK LAYOUT

WHERE: forward | backward | optimizer | callback | dataloader (raise) or hang (sleep forever), on global
rank RANK at step 2. LAYOUT: "dp,pp,tp". Before failing, the rank writes the time to OUT_DIR/fault_time.
slow_phases: on rank RANK, configure_model, a checkpoint's save (fit 1) and its load (fit 2, resuming it)
each take longer than hang_timeout, which is no hang; then it hangs in training_step at step 2. Each slow
phase, once over, writes OUT_DIR/slow_<name>.
"""

import functools
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import torch.distributed as dist

from lightning_3d import ThreeDStrategy
from lightning_3d.checkpoint import sharded
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

OUT, WHERE, RANK = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
STEP = 2
# Short where a hang is the point; for a raising rank long, so that a slow step on a loaded host (8 ranks on
# 2 cores) is not reported as a hang before the injected failure. The hang test's steps before the injected
# hang took over 5 s each beside 6 busy processes on 2 cores (load 10): 15 s leaves them 3 times that.
HANG_TIMEOUT = {"slow_phases": 3, "hang": 15}.get(WHERE, 120)
# How long a reporting rank waits for the others to print what they wait in (ThreeDStrategy(exit_timeout=)).
# The hang test needs every rank's report: on a loaded host (8 ranks of other tests on 2 cores) 5 s was once
# too short for one rank's ack (3 of 4 reports, a fresh clone under ATEN_CPU_CAPABILITY=default).
EXIT_TIMEOUT = 15 if WHERE == "hang" else 5
SLOW_S = 1.5 * HANG_TIMEOUT  # a slow phase (set-up, a checkpoint's save or load): longer than hang_timeout


def fault(trainer_rank: int, step: int, here: str) -> None:
    if here == ("hang" if WHERE == "slow_phases" else WHERE) and trainer_rank == RANK and step == STEP:
        (OUT / "fault_time").write_text(str(time.time()))
        if here == "hang":
            while True:  # a rank that never arrives at the next collective
                time.sleep(0.05)
        raise ValueError(f"injected failure in {WHERE}")


def slow(name: str, rank: int) -> None:
    if WHERE == "slow_phases" and rank == RANK and not (OUT / f"slow_{name}").exists():
        time.sleep(SLOW_S)
        (OUT / f"slow_{name}").touch()


def slowly(name: str, function):
    @functools.wraps(function)
    def slow_function(*args, **kwargs):
        slow(name, dist.get_rank())  # slow storage
        return function(*args, **kwargs)
    return slow_function


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        fault(ctx.module.global_rank, ctx.module.global_step, "backward")
        return grad, None


class Module(GPTLightningModule):
    def training_step(self, batch, batch_idx):
        fault(self.global_rank, self.global_step, "forward")
        fault(self.global_rank, self.global_step, "hang")
        return super().training_step(batch, batch_idx)

    def configure_model(self):
        slow("configure_model", self.global_rank)  # a large model
        super().configure_model()
        for block in self.model.blocks.values():  # whichever of them this rank's pipeline stage holds
            block.register_forward_hook(lambda m, a, out: FailingBackward.apply(out, self))

    def optimizer_step(self, *args, **kwargs):
        fault(self.global_rank, self.global_step, "optimizer")
        return super().optimizer_step(*args, **kwargs)


class FailingCallback(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        fault(trainer.global_rank, trainer.global_step, "callback")


class SaveAtFirstStep(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 1:
            trainer.save_checkpoint(OUT / "checkpoint")


class Data(SyntheticDataModule):
    def train_dataloader(self):
        return FailingLoader(super().train_dataloader(), self.trainer.global_rank)


class FailingLoader:
    """The data loader of this rank fails when it fetches batch STEP."""

    def __init__(self, loader: DataLoader, rank: int) -> None:
        self.loader, self.rank = loader, rank

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for index, batch in enumerate(self.loader):
            fault(self.rank, index, "dataloader")
            yield batch


def fit(layout: str, max_steps: int, callbacks: list, **fit_kwargs) -> None:
    dp, pp, tp = map(int, layout.split(","))
    strategy = ThreeDStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                              hang_timeout=HANG_TIMEOUT, exit_timeout=EXIT_TIMEOUT)
    trainer = L.Trainer(accelerator="cpu", devices=dp * pp * tp, strategy=strategy, max_steps=max_steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(Module(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)),
                Data(seq_len=16, batch_size=4), **fit_kwargs)


def main() -> None:
    L.seed_everything(0, verbose=False)
    if WHERE == "slow_phases":
        sharded.save, sharded.load = slowly("save", sharded.save), slowly("load", sharded.load)
        fit(sys.argv[4], 1, [SaveAtFirstStep()])
        fit(sys.argv[4], 6, [], ckpt_path=OUT / "checkpoint")
    else:
        fit(sys.argv[4], 6, [FailingCallback()])


if __name__ == "__main__":
    main()
