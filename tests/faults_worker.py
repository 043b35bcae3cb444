"""One rank fails or hangs on purpose; the fault watch (lightning_3d.faults) must take the job down.

    python -m torch.distributed.run --standalone --nproc-per-node N faults_worker.py OUT_DIR WHERE RANK LAYOUT

WHERE: forward | backward | optimizer | callback | dataloader (raise) or hang (sleep forever), on global
rank RANK at step 2. LAYOUT: "dp,pp,tp". Before failing, the rank writes the time to OUT_DIR/fault_time.
"""

import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

OUT, WHERE, RANK = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
STEP = 2


def fault(trainer_rank: int, step: int, here: str) -> None:
    if here == WHERE and trainer_rank == RANK and step == STEP:
        (OUT / "fault_time").write_text(str(time.time()))
        if WHERE == "hang":
            while True:  # a rank that never arrives at the next collective
                time.sleep(0.05)
        raise ValueError(f"injected failure in {WHERE}")


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
        super().configure_model()
        for block in self.model.blocks.values():  # whichever of them this rank's pipeline stage holds
            block.register_forward_hook(lambda m, a, out: FailingBackward.apply(out, self))

    def optimizer_step(self, *args, **kwargs):
        fault(self.global_rank, self.global_step, "optimizer")
        return super().optimizer_step(*args, **kwargs)


class FailingCallback(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        fault(trainer.global_rank, trainer.global_step, "callback")


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


def main() -> None:
    dp, pp, tp = map(int, sys.argv[4].split(","))
    L.seed_everything(0, verbose=False)
    strategy = ThreeDStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                              hang_timeout=5, exit_timeout=5)
    trainer = L.Trainer(accelerator="cpu", devices=dp * pp * tp, strategy=strategy, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[FailingCallback()])
    trainer.fit(Module(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)),
                Data(seq_len=16, batch_size=4))


if __name__ == "__main__":
    main()
