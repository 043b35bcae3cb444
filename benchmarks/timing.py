"""Shared pieces of the benchmarks: start under torchrun, time optimizer steps, alternate, report a ratio."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

WARMUP_STEPS = 5
VIRTUAL_STAGES = 2
"""Stages per rank the benchmarks give the interleaved schedules (interleaved 1F1B, zero-bubble)."""


def virtual_stages(schedule: str) -> int:
    """How many stages per pipeline rank a benchmark runs ``schedule`` with."""
    from lightning_3d.common import MULTI_STAGE_SCHEDULES

    return VIRTUAL_STAGES if schedule in MULTI_STAGE_SCHEDULES else 1


def ensure_torchrun(nprocs: int) -> None:
    """Re-run this script under torchrun with ``nprocs`` processes unless it already runs under it."""
    if "LOCAL_RANK" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", *sys.argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sys.exit(subprocess.call(cmd, env=env))


def step_times(strategy, module, datamodule, steps: int, devices: int, accumulate_grad_batches: int = 1,
               warmup: int = WARMUP_STEPS, callbacks: Sequence = ()) -> list[float]:
    """Seconds per training batch of one ``Trainer.fit``, after ``warmup`` untimed batches."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *_args) -> None:
            self.ends.append(time.perf_counter())

    timer = StepTimer()
    L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps + warmup, logger=False,
              accumulate_grad_batches=accumulate_grad_batches,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer, *callbacks]).fit(module, datamodule)
    return [b - a for a, b in zip(timer.ends[warmup - 1:], timer.ends[warmup:])]


def compare(runs: dict[str, Callable[[], list[float]]], rounds: int, title: str) -> None:
    """Alternate the runs ``rounds`` times (order flipped every round), print medians and the ratio first/second."""
    import torch.distributed as dist

    names = list(runs)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            medians[name].append(statistics.median(runs[name]()))
    if dist.get_rank() == 0:
        print(f"\n{title}")
        for name, values in medians.items():
            print(f"  {name:>16}: median step {' '.join(f'{v * 1e3:7.2f}' for v in values)} ms")
        ratio = statistics.median(medians[names[0]]) / statistics.median(medians[names[1]])
        print(f"ratio {names[0]} / {names[1]} step time: {ratio:.3f}")
