"""Per-rank bytes the planner predicts, measured (``test_planner``): parameters, gradients and optimizer state
(``memory_report``) and the peak of activations saved for backward during a training step.

    python -m torch.distributed.run --standalone --nproc-per-node N planner_worker.py CASES_JSON OUT_DIR

Each case is ``{"name", "strategy": ThreeDStrategy kwargs, "model": GPTConfig kwargs, "batch_size",
"precision"}``; every rank writes ``rank{R}.json`` with, per case, its (dp, pp, tp) coordinates and bytes."""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.parallel.memory import SavedActivations, memory_report


class Measure(L.Callback):
    def __init__(self) -> None:
        self.saved: SavedActivations | None = None
        self.report: dict[str, int] = {}
        self.peak = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.saved = SavedActivations(pl_module)
        self.saved.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.saved.__exit__(None, None, None)
        # The last step's peak: the first step also holds what the pipeline's shape inference kept from its
        # extra forward, which later steps do not.
        self.peak = self.saved.peak
        self.report = memory_report(pl_module, trainer.optimizers)


def main(cases_file: str, out_dir: str) -> None:
    results = {}
    for case in json.loads(Path(cases_file).read_text()):
        L.seed_everything(0, verbose=False)
        measure = Measure()
        strategy = ThreeDStrategy(**case["strategy"])
        trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            precision=case.get("precision", "32-true"), callbacks=[measure])
        config = GPTConfig(**case["model"])
        trainer.fit(GPTLightningModule(config=config),
                    SyntheticDataModule(vocab_size=config.vocab_size, seq_len=config.block_size,
                                        batch_size=case["batch_size"]))
        results[case["name"]] = {**measure.report, "activations": measure.peak,
                                 "coords": list(strategy.coords)}
    rank = torch.distributed.get_rank()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
