"""A callback that a CLI run under test adds by class path (``helpers.cli_probe.RankProbe``): each
rank writes where it sat and what it trained, so a test can check a launch made by torchrun or srun."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch

# What the launcher told this process, as the test wants to see it (absent ones are left out).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                      "SLURMD_NODENAME", "SLURM_NTASKS", "SLURM_JOB_ID")


class RankProbe(L.Callback):
    """Writes ``out_dir/rank{global_rank}.json`` at the end of fit: the cluster environment Lightning picked, the
    global rank and world size, the (dp, pp, tp) coordinates, the launcher's variables and the per-step loss
    (mean over all ranks, the same number on every rank)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # A collective: every rank runs it for every batch, so no rank waits alone.
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())

    def on_fit_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        record = {
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "layout": str(strategy.parallel_dims),
            "coords": strategy.coords._asdict(),
            "env": {k: os.environ[k] for k in LAUNCHER_VARIABLES if k in os.environ},
            "losses": self.losses,
            "intra_op_threads": torch.get_num_threads(),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def read_ranks(out_dir: Path, world_size: int) -> list[dict]:
    """The records of ranks 0..world_size-1, in rank order; fails naming the ranks that wrote none."""
    missing = [r for r in range(world_size) if not (out_dir / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no record in {out_dir}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
