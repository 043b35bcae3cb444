"""Run under torchrun (2 ranks): a GPT under a pp=2 1F1B pipeline with PipelineMonitor and a TensorBoard
logger; each rank writes what the monitor measured.

    python -m torch.distributed.run --nproc-per-node 2 pipeline_monitor_worker.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from torch.distributed.pipelining import schedules
from torch.overrides import TorchFunctionMode

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import PipelineMonitor
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

MICROBATCHES = 4
HOST_CONVERSIONS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy"}


class HostConversions(TorchFunctionMode):
    """Records every conversion of a tensor's values to Python (on CUDA each one waits for the device)."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_CONVERSIONS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def record_host_conversions_inside_schedules(seen: list, after_steps: int) -> None:
    """From the ``after_steps + 1``-th schedule step on (the first ones infer shapes and check once), run every
    pipeline schedule's step under :class:`HostConversions`."""
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step
        calls = [0]

        def step(self, *args, _original=original, _calls=calls, **kwargs):
            _calls[0] += 1
            if _calls[0] <= after_steps:
                return _original(self, *args, **kwargs)
            with HostConversions(seen):
                return _original(self, *args, **kwargs)
        cls.step = step


def fit(out_dir: str, max_steps: int, trace_dir=None, **strategy_kwargs) -> tuple[L.Trainer, PipelineMonitor]:
    L.seed_everything(0, verbose=False)
    monitor = PipelineMonitor(every_n_steps=2, trace_dir=trace_dir)
    strategy = ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=MICROBATCHES, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                        enable_checkpointing=False, logger=TensorBoardLogger(out_dir, name="tb"), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[monitor])
    # Micro-batches large enough that compute, not gloo's latency, fills the step.
    config = GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=64, vocab_size=64)
    trainer.fit(GPTLightningModule(config=config), SyntheticDataModule(seq_len=64, batch_size=8 * MICROBATCHES))
    return trainer, monitor


def main(out_dir: str) -> None:
    host_conversions: list[str] = []
    record_host_conversions_inside_schedules(host_conversions, after_steps=1)
    # Zero-bubble first (its TensorBoard run is version_0), to check the weight-gradient actions are seen too.
    _, zero_bubble = fit(out_dir, 3, pipeline_schedule="zero_bubble", virtual_pipeline_size=2)
    trace_dir = Path(out_dir) / "traces"
    trainer, monitor = fit(out_dir, 5, trace_dir=trace_dir, pipeline_schedule="1f1b")
    result = {
        "zero_bubble_rows": [[list(a) for a in row] for row in zero_bubble.last_rows],
        "rows": [[list(a) for a in row] for row in monitor.last_rows],
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pipeline/")},
        "image_shape": list(monitor.last_image.shape) if monitor.last_image is not None else None,
        "image_colors": sorted({tuple(p) for p in monitor.last_image.reshape(-1, 3).tolist()})
        if monitor.last_image is not None else [],
        "log_dir": trainer.logger.log_dir if dist.get_rank() == 0 else None,
        "title": monitor.title,
        "traces": {p.name: json.loads(p.read_text()) for p in sorted(trace_dir.glob("*.json"))}
        if dist.get_rank() == 0 else {},
        "host_conversions_in_schedules": host_conversions,
    }
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
