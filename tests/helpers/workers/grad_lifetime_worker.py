"""Entry point of tests/parity/test_pipeline_grad_memory.py: a reference GPT on 4 ranks, trained at dp2 x pp2
and pp2 x tp2 (1F1B, 2 micro-batches), at pp2 x tp2 with ``accumulate_grad_batches=2``, and at dp2 x tp2. A callback keeps weak references to the gradients each step leaves and, during the next step's
schedule (a forward pre-hook on every linear layer the rank holds), notes whether they are still alive; and
before each optimizer step it notes every split weight whose gradient is not split like it, or holds more
memory than its own elements. Each rank writes what it saw.

    python forkrun.py 4 grad_lifetime_worker.py OUT_DIR
"""

import json
import sys
import weakref
from pathlib import Path

import lightning as L
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

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


class GradLayout(L.Callback):
    """Split weights whose gradient, at the optimizer step, is not split like the weight; and gradients that
    view a larger tensor than themselves (meaningful without data parallel: FSDP2 keeps all of a unit's
    gradients in one flat buffer, by design)."""

    def __init__(self) -> None:
        self.unlike: set[str] = set()
        self.oversized: set[str] = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for name, param in pl_module.named_parameters():
            if not isinstance(param, DTensor) or not isinstance(param.grad, DTensor):
                continue
            if param.grad.placements != param.placements:
                self.unlike.add(f"{name}: {param.grad.placements} for {param.placements}")
            piece = param.grad.to_local()
            if piece.untyped_storage().nbytes() > piece.numel() * piece.element_size():
                self.oversized.add(f"{name}: {tuple(piece.shape)} in {piece.untyped_storage().nbytes()} bytes")


def run(accumulate: int, **layout) -> dict:
    L.seed_everything(0, verbose=False)
    lifetime, grad_layout = GradLifetime(), GradLayout()
    pipelined = layout.get("pipeline_parallel_size", 1) > 1
    strategy = ThreeDStrategy(**layout, **(dict(num_microbatches=2) if pipelined else {}))
    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=2, accumulate_grad_batches=accumulate,
                        strategy=strategy, callbacks=[lifetime, grad_layout], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    module = GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64))
    trainer.fit(module, SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=4))
    return {"alive": {str(batch): alive for batch, alive in lifetime.alive.items()},
            "grads_unlike_weights": sorted(grad_layout.unlike), "oversized_grads": sorted(grad_layout.oversized)}


def main(out_dir: str) -> None:
    pp2_tp2 = dict(pipeline_parallel_size=2, tensor_parallel_size=2)
    result = {"dp2_pp2": run(1, pipeline_parallel_size=2), "pp2_tp2": run(1, **pp2_tp2),
              "pp2_tp2_accumulate_2": run(2, **pp2_tp2), "dp2_tp2": run(1, tensor_parallel_size=2)}
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
