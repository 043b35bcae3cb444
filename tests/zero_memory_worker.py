"""Per-rank bytes of parameters, gradients and optimizer state for each ZeRO stage (``test_zero_memory``).

    python -m torch.distributed.run --standalone --nproc-per-node N zero_memory_worker.py OUT_DIR

Every rank writes ``rank{R}.json``: for each stage, ``memory_report`` after two optimizer steps, and the
bytes of parameters held gathered (not as dp shards) when the last block's forward ends."""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from harness import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.parallel.memory import memory_report

CONFIG = GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=32)


class Measure(L.Callback):
    def __init__(self) -> None:
        self.report: dict[str, int] = {}
        self.gathered_at_end_of_forward = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        def count_gathered(module, args, output) -> None:
            # Parameters at rest as dp shards are DTensors; FSDP2 swaps in plain tensors while gathered (tp = 1).
            gathered = [p for p in pl_module.parameters() if not isinstance(p, DTensor)]
            self.gathered_at_end_of_forward = max(self.gathered_at_end_of_forward,
                                                  sum(p.numel() * p.element_size() for p in gathered))

        list(pl_module.model.blocks.values())[-1].register_forward_hook(count_gathered)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.report = memory_report(pl_module, trainer.optimizers)


def main(out_dir: str) -> None:
    results = {}
    for zero in (0, 1, 2, 3):
        L.seed_everything(0, verbose=False)
        measure = Measure()
        trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                            strategy=ThreeDStrategy(zero_stage=zero), max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0,
                            callbacks=[measure])
        module = GPTLightningModule(config=CONFIG)
        trainer.fit(module, SyntheticDataModule(vocab_size=CONFIG.vocab_size, seq_len=CONFIG.block_size,
                                                batch_size=4))
        results[zero] = {**measure.report, "gathered_at_end_of_forward": measure.gathered_at_end_of_forward}
    rank = torch.distributed.get_rank()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
