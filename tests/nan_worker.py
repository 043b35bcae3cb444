"""Run under torchrun (2 ranks, data parallel): rank 1 turns its loss into NaN at step 2; NaNGuard must name
rank 1 -- not rank 0, whose gradients only turn NaN in the all-reduce -- and raise or skip on both ranks.

    python -m torch.distributed.run --nproc-per-node 2 nan_worker.py OUT_DIR ACTION
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from harness import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import NaNGuard
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


class NaNOnRank1(GPTLightningModule):
    """At step 2, on rank 1 only: the output of block 1 turns NaN (as an overflow would)."""

    def configure_model(self):
        super().configure_model()
        self.model.blocks["1"].register_forward_hook(self._poison)

    def _poison(self, module, args, output):
        if self.global_rank == 1 and self.trainer.global_step == 2:
            return output * float("nan")
        return output


def main(out_dir: str, action: str) -> None:
    L.seed_everything(0, verbose=False)
    guard = NaNGuard(action=action, check_activations=True)
    module = NaNOnRank1(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ThreeDStrategy(), max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.callbacks.append(guard)
    error = None
    try:
        trainer.fit(module, SyntheticDataModule(seq_len=16, batch_size=4))
    except FloatingPointError as err:
        error = str(err)
    params = [p.detach() for p in module.parameters()]
    result = {"error": error, "skipped": guard.skipped_steps, "steps": trainer.global_step,
              "finite": all(bool(torch.isfinite(p).all()) for p in params),
              "checksum": float(sum(p.double().sum() for p in params))}
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
