"""Entry point of tests/parity/test_pipeline_grad_memory.py: a reference GPT at pp=2 (1F1B, 2 micro-batches),
trained twice -- without gradient accumulation, then with ``accumulate_grad_batches=2`` -- while a callback
keeps weak references to the gradients each step leaves and, during the next step's schedule (a forward
pre-hook on every linear layer the rank holds), notes whether they are still alive. Each rank writes what it
saw.

    python forkrun.py 2 grad_lifetime_worker.py OUT_DIR
"""

import json
import sys
import weakref
from pathlib import Path

import lightning as L
import torch.distributed as dist
from torch import nn

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


class GradLifetime(L.Callback):
    """Per batch after the first: were the previous batch's gradients alive while this batch's schedule ran?"""

    def __init__(self) -> None:
        self.previous: list[weakref.ref] = []
        self.alive: dict[int, bool] = {}
        self.batch = -1

    def on_train_start(self, trainer, pl_module) -> None:
        for module in pl_module.modules():
            if isinstance(module, nn.Linear) and not module.weight.is_meta:
                module.register_forward_pre_hook(self._check)

    def _check(self, *_args) -> None:
        if self.batch > 0 and self.previous:
            alive = any(ref() is not None for ref in self.previous)
            self.alive[self.batch] = self.alive.get(self.batch, False) or alive

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.previous = [weakref.ref(p.grad) for p in pl_module.parameters() if p.grad is not None]


def run(accumulate: int) -> dict:
    L.seed_everything(0, verbose=False)
    watch = GradLifetime()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, accumulate_grad_batches=accumulate,
                        strategy=ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2), callbacks=[watch],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    module = GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64))
    trainer.fit(module, SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=4))
    return {str(batch): alive for batch, alive in watch.alive.items()}


def main(out_dir: str) -> None:
    result = {"no_accumulation": run(1), "accumulate_2": run(2)}
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
