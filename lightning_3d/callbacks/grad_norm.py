"""GradNormMonitor: the true global gradient norm of a 3D run, per-stage and per-rank norms, and outliers."""

from __future__ import annotations

import logging
import math
from statistics import median_low

import lightning as L
import torch
import torch.distributed as dist

from lightning_3d.callbacks.layout import dims_of
from lightning_3d.parallel.clip import grad_square_terms

log = logging.getLogger(__name__)


class GradNormMonitor(L.Callback):
    """Logs, before each optimizer step (before clipping):

    * ``grad_norm/global`` -- the norm of the whole model's gradient, every tp shard, pp stage and dp replica
      counted once: what one process would compute for the same model;
    * ``grad_norm/stage_{s}`` -- the part of it on pipeline stage ``s``;
    * ``grad_norm/rank_max`` and ``grad_norm/rank_median`` -- of each rank's local gradient norm;

    and warns, naming the rank and its (dp, pp, tp) coordinates, when a rank's local norm exceeds
    ``outlier_factor`` times the median of the ranks of its pipeline stage (which hold comparable pieces) --
    the "one rank's shard has huge gradients" failure of large runs. One small all-gather over the world per
    logged step; every rank takes part, so it cannot hang.

    Example::

        trainer = L.Trainer(strategy=ThreeDStrategy(tensor_parallel_size=2), callbacks=[GradNormMonitor()])
    """

    def __init__(self, every_n_steps: int | None = None, outlier_factor: float = 10.0) -> None:
        self.every_n_steps = every_n_steps
        self.outlier_factor = outlier_factor
        self.outliers: list[dict] = []
        """Every outlier seen: step, rank, coordinates, its norm and the stage median."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        dims = dims_of(trainer)
        share, local = grad_square_terms(pl_module.parameters(), dims)
        terms = torch.stack([share, local]).to(pl_module.device)
        gathered = [terms]
        if dist.is_initialized():
            gathered = [torch.zeros_like(terms) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, terms)
        per_rank = torch.stack(gathered).tolist()  # (world, 2): the one host read; plain floats from here on
        local_norms = [math.sqrt(squares) for _, squares in per_rank]
        # median_low: torch.median's choice of the lower middle value for an even count
        metrics = {"grad_norm/global": math.sqrt(sum(share for share, _ in per_rank)),
                   "grad_norm/rank_max": max(local_norms), "grad_norm/rank_median": median_low(local_norms)}
        stage_of = [dims.coords(rank).pp for rank in range(len(per_rank))]
        for stage in range(dims.pp):
            ranks = [rank for rank, its_stage in enumerate(stage_of) if its_stage == stage]
            metrics[f"grad_norm/stage_{stage}"] = math.sqrt(sum(per_rank[rank][0] for rank in ranks))
            self._flag_outliers(trainer.global_step, dims, local_norms, ranks)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def _flag_outliers(self, step: int, dims, local_norms: list[float], ranks: list[int]) -> None:
        """Warns about each of ``ranks`` (one stage's) whose local norm is over ``outlier_factor`` x their median."""
        if len(ranks) < 2:
            return
        median = median_low([local_norms[rank] for rank in ranks])
        for rank in ranks:
            norm = local_norms[rank]
            if median > 0 and norm > self.outlier_factor * median:
                outlier = {"step": step, "rank": rank, "coords": dims.named_coords(rank), "norm": norm,
                           "stage_median": median}
                self.outliers.append(outlier)
                log.warning("lightning_3d: rank %d %s has a local gradient norm %.3g, %.1fx the median of its"
                            " stage (%.3g) at step %d", rank, outlier["coords"], norm, norm / median, median, step)
