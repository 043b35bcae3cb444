"""Run under torchrun (4 ranks): CommTimer on several layouts of the reference GPT in one launch; each rank
writes, per layout, the operations CommTimer saw in the last training batch and its per-dimension values.

    python -m torch.distributed.run --nproc-per-node 4 comm_worker.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from harness import end_process_group
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
}


def run(kwargs: dict | str) -> dict:
    L.seed_everything(0, verbose=False)
    timer = CommTimer(every_n_steps=1)
    strategy = kwargs if isinstance(kwargs, str) else ThreeDStrategy(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(GPTLightningModule(config=GPTConfig(**MODEL)), SyntheticDataModule(seq_len=16, batch_size=BATCH))
    return {"ops": timer.last_ops, "values": timer.per_rank[dist.get_rank()],
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}}


def main(out_dir: str) -> None:
    results = {name: run(kwargs) for name, kwargs in LAYOUTS.items()}
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
