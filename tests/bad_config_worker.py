"""Run under torchrun: try each bad configuration on every rank and report what each rank raised.

Each rank writes a JSON file (stdout lines of several ranks can interleave): per case, the exception type and
message, and whether a process group existed afterwards (it must not: the error has to come before any
collective, or ranks could hang).

    python -m torch.distributed.run --nproc-per-node 2 bad_config_worker.py OUT_DIR CASE [CASE ...]
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist
from torch import nn

from harness import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)


class NoModel(L.LightningModule):
    def training_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return None


class RaggedData(SyntheticDataModule):
    """10 samples in batches of 4: the third batch has 2 (fine for 2 micro-batches, but a new shape)."""

    def __init__(self):
        super().__init__(seq_len=16, batch_size=4, num_train_samples=10)

    def train_dataloader(self):
        from torch.utils.data import DataLoader
        return DataLoader(self.train_set, batch_size=4, drop_last=False)


class ManualOptimization(GPTLightningModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False


class EagerModel(GPTLightningModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = nn.Linear(2, 2)


CASES = {
    "dp_times_tp_pp_is_not_world": lambda: (ThreeDStrategy(data_parallel_size=3), GPTLightningModule(config=TINY)),
    "tp_pp_does_not_divide_world": lambda: (ThreeDStrategy(pipeline_parallel_size=3), GPTLightningModule(config=TINY)),
    "unknown_policy": lambda: (ThreeDStrategy(policy="no_such_policy"), GPTLightningModule(config=TINY)),
    "no_model_at_all": lambda: (ThreeDStrategy(), NoModel()),
    "meta_init_of_an_eager_model": lambda: (ThreeDStrategy(model_init="meta"), EagerModel(config=TINY)),
    "unavailable_feature": lambda: (ThreeDStrategy(init_from="weights.pt"), GPTLightningModule(config=TINY)),
    "offload_without_sharding": lambda: (ThreeDStrategy(offload=True), GPTLightningModule(config=TINY)),
    "non_positive_size": lambda: (ThreeDStrategy(tensor_parallel_size=0), GPTLightningModule(config=TINY)),
    "too_few_microbatches_for_1f1b": lambda: (ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=1),
                                              GPTLightningModule(config=TINY)),
    "too_few_blocks_for_the_stages": lambda: (ThreeDStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                                                             virtual_pipeline_size=2), GPTLightningModule(config=TINY)),
    "batch_not_divisible_into_microbatches": lambda: (ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=4),
                                                      GPTLightningModule(config=TINY), SyntheticDataModule(seq_len=16, batch_size=6)),
    "manual_optimization_under_pipeline": lambda: (ThreeDStrategy(pipeline_parallel_size=2),
                                                   ManualOptimization(config=TINY)),
    "batch_shape_changes_between_steps": lambda: (ThreeDStrategy(pipeline_parallel_size=2),
                                                  GPTLightningModule(config=TINY), RaggedData()),
}


def main(out_dir: str, names: list[str]) -> None:
    results = []
    for name in names:
        error = None
        try:
            strategy, module, *data = CASES[name]()
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, data[0] if data else SyntheticDataModule(seq_len=16, batch_size=2))
        except Exception as err:  # noqa: BLE001  (reporting whatever was raised is the point)
            error = {"type": type(err).__name__, "message": str(err)}
        results.append({"case": name, "error": error, "process_group": dist.is_initialized()})
    (Path(out_dir) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
