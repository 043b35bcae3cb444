"""Peak host memory of a meta-device init at tp * pp = 8 (``test_meta_init_memory``).

    python -m torch.distributed.run --standalone --nproc-per-node 8 meta_init_worker.py OUT_DIR

Each rank writes ``rank{R}.json``: its parameter bytes after setup and the growth of its resident set (peak,
from just before ``fit`` to the start of training) while the strategy built, split, sharded and initialized
the model."""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.parallel.memory import memory_report

# ~151 MB of fp32 parameters (37.8 M), almost all in the blocks: large next to a rank's fixed overhead.
CONFIG = GPTConfig(n_layer=12, n_embd=512, n_head=8, block_size=64, vocab_size=64)
LAYOUT = dict(pipeline_parallel_size=2, tensor_parallel_size=4)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Measure(L.Callback):
    def __init__(self, baseline_kib: int) -> None:
        self.baseline_kib = baseline_kib
        self.result: dict = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        self.result = {"parameter_bytes": memory_report(pl_module)["parameters"],
                       "peak_rss_growth_bytes": (_status_kib("VmHWM") - self.baseline_kib) * 1024,
                       "model_init": trainer.strategy.parallel_config.model_init}


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(config=CONFIG)
    data = SyntheticDataModule(vocab_size=CONFIG.vocab_size, seq_len=CONFIG.block_size, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=ThreeDStrategy(**LAYOUT, num_microbatches=2), max_steps=1, limit_train_batches=1,
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # Start the peak (VmHWM) afresh from the current resident set: what follows is the strategy's doing.
    Path("/proc/self/clear_refs").write_text("5")
    measure = Measure(_status_kib("VmRSS"))
    trainer.callbacks.append(measure)
    trainer.fit(module, data)
    (Path(out_dir) / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(measure.result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
