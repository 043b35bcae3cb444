"""Run under torchrun (4 ranks): CommTimer on several layouts of the reference GPT in one launch; each rank
writes, per layout, the operations CommTimer saw in the last training batch and its per-dimension values.

    python -m torch.distributed.run --nproc-per-node 4 comm_worker.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import CommTimer
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)
BATCH = 4  # per data-parallel rank
LAYOUTS = {  # name: ThreeDStrategy arguments (or another strategy's name) on 4 ranks
    "dp2_pp1_tp2": dict(tensor_parallel_size=2),
    "dp1_pp2_tp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2),
    "dp2_pp2_tp1": dict(pipeline_parallel_size=2, num_microbatches=2),
    "dp4_pp1_tp1": dict(),
    "dp2_pp1_tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True),
    "lightning_ddp": "ddp",  # not ThreeDStrategy: the world is one data-parallel group
    "hsdp_rep2_shard2_zero2": dict(data_parallel_size=4, data_parallel_shard_size=2, zero_stage=2),
}
PIPELINE = dict(pipeline_parallel_size=2, num_microbatches=2)
ACCUMULATING = {  # name: ThreeDStrategy arguments at (dp, pp, tp) = (2, 2, 1), with accumulate_grad_batches=2
    "dp2_pp2_tp1_accumulate2": PIPELINE,
    "dp2_pp2_tp1_zero2_accumulate2": dict(PIPELINE, zero_stage=2),
    "dp2_pp2_tp1_zero2_per_microbatch_accumulate2": dict(PIPELINE, zero_stage=2,
                                                         pipeline_reduce_grads="per_microbatch"),
}


class OpsPerBatch(L.Callback):
    """Every batch's operations, as the CommTimer before it in the callbacks saw them."""

    def __init__(self, timer: CommTimer) -> None:
        self.timer, self.batches = timer, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append(self.timer.last_ops)


def run(kwargs: dict | str, accumulate_grad_batches: int = 1, max_steps: int = 3) -> dict:
    L.seed_everything(0, verbose=False)
    timer = CommTimer(every_n_steps=1)
    per_batch = OpsPerBatch(timer)
    strategy = kwargs if isinstance(kwargs, str) else ThreeDStrategy(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=max_steps,
                        accumulate_grad_batches=accumulate_grad_batches, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer, per_batch])
    trainer.fit(GPTLightningModule(config=GPTConfig(**MODEL)), SyntheticDataModule(seq_len=16, batch_size=BATCH))
    return {"ops": timer.last_ops, "values": timer.per_rank[dist.get_rank()], "per_batch": per_batch.batches,
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}}


def main(out_dir: str) -> None:
    results = {name: run(kwargs) for name, kwargs in LAYOUTS.items()}
    results.update({name: run(kwargs, accumulate_grad_batches=2, max_steps=2) for name, kwargs in ACCUMULATING.items()})
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
