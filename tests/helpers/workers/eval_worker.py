"""validate() and predict() through a layout; each rank writes what it got (JSON).

    python -m torch.distributed.run --nproc-per-node N eval_worker.py OUT_DIR PP [TP]   (or plain python: one process)
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


class PredictingGPT(GPTLightningModule):
    def predict_step(self, batch, batch_idx):
        tokens, _ = batch
        logits = self.model(tokens)
        return {"next_token": logits.argmax(-1), "logits": logits}


def main(out_dir: str, pp: int, tp: int = 1) -> None:
    L.seed_everything(1234, verbose=False)
    module = PredictingGPT(config=GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16))
    data = SyntheticDataModule(seq_len=16, batch_size=8)
    data.setup("validate")
    loader = DataLoader(data.val_set, batch_size=8)
    devices = int(os.environ.get("WORLD_SIZE", 1))
    strategy = ThreeDStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=4) \
        if pp * tp > 1 else ThreeDStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=2, limit_predict_batches=2)
    val_loss = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    predictions = trainer.predict(module, loader)
    tokens = torch.cat([p["next_token"] for p in predictions]).tolist()
    logits = torch.cat([p["logits"] for p in predictions])
    assert type(logits) is torch.Tensor, type(logits)  # whole, not the rank's vocabulary shard
    rank = int(os.environ.get("RANK", 0))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"val_loss": val_loss, "next_token": tokens,
                                                                       "logits_sum": float(logits.double().sum()),
                                                                       "logits_shape": list(logits.shape)}))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
