"""Per-rank bytes of parameters, gradients and optimizer state for each ZeRO stage (``test_zero_memory``).

    python -m torch.distributed.run --standalone --nproc-per-node N zero_memory_worker.py OUT_DIR

Every rank writes ``rank{R}.json``: for each stage, ``memory_report`` after two optimizer steps, and the
bytes of parameters held gathered (not as dp shards) when the last block's forward ends. With 4 ranks it also
runs (dp, pp, tp) = (2, 2, 1) at ZeRO-2 and 3 with each ``pipeline_reduce_grads``: the most gradient bytes
the rank held at once during its second step (``GradientPeak``), and the strategy's logged memory line."""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.parallel.memory import memory_report, step_gradient_bytes

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


class GradientPeak(TorchDispatchMode):
    """The most gradient bytes held at once, looked at after every operator of a training batch: FSDP2's
    gathered gradients (on its unsharded parameters, before they are reduce-scattered) plus the dp shards.
    This reads FSDP2's per-parameter state: nothing public says where a gradient is before its reduction."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        super().__init__()
        units = {m for module in modules for m in module.modules() if isinstance(m, FSDPModule)}
        self.params = [fsdp_param for m in units
                       for group in fully_shard.state(m)._fsdp_param_groups for fsdp_param in group.fsdp_params]
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, sum(_held_grad_bytes(p) for p in self.params))
        return out


def _held_grad_bytes(fsdp_param) -> int:
    tensors = [fsdp_param.sharded_param.grad, fsdp_param.unsharded_accumulated_grad]
    if hasattr(fsdp_param, "_unsharded_param"):
        tensors.append(fsdp_param._unsharded_param.grad)
    locals_ = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in locals_)


class MeasureGradients(L.Callback):
    """The gradient peak of the second training batch (the first also runs the schedule's shape inference)."""

    def __init__(self) -> None:
        self.mode: GradientPeak | None = None
        self.peak = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:  # the pipeline's stages: copies of the model's root around its blocks
            self.mode = GradientPeak([pl_module, *trainer.strategy.pipeline_engine.stages.values()])
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.peak, self.mode = self.mode.peak, None


PIPELINED_CONFIG = GPTConfig(n_layer=8, n_embd=64, n_head=4, block_size=32)  # 4 blocks per stage
PIPELINED = {  # (dp, pp, tp) = (2, 2, 1), 4 micro-batches of 1 sequence
    f"zero{zero}_pp2_{when}": dict(zero_stage=zero, pipeline_parallel_size=2, num_microbatches=4,
                                   pipeline_reduce_grads=when)
    for zero in (2, 3) for when in ("per_step", "per_microbatch")
}


def pipelined(name: str, kwargs: dict) -> dict:
    L.seed_everything(0, verbose=False)
    measure = MeasureGradients()
    strategy = ThreeDStrategy(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[measure])
    config = PIPELINED_CONFIG
    trainer.fit(GPTLightningModule(config=config), SyntheticDataModule(vocab_size=config.vocab_size,
                                                                       seq_len=config.block_size, batch_size=4))
    predicted = step_gradient_bytes(strategy.pipeline_engine.stages.values(),
                                    kwargs["pipeline_reduce_grads"] == "per_microbatch")
    return {"gradient_peak": measure.peak, "step_gradient_bytes": predicted, "pp_rank": strategy.coords.pp}


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
    if int(os.environ["WORLD_SIZE"]) == 4:
        results.update({name: pipelined(name, kwargs) for name, kwargs in PIPELINED.items()})
    rank = torch.distributed.get_rank()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
