"""What a user can get wrong about the model and the features, checked on every rank before any collective."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError


def check_model(module: Optional[pl.LightningModule], config: ParallelConfig) -> None:
    if module is None:
        return
    built_eagerly = any(not p.is_meta for p in module.parameters())
    if not is_overridden("configure_model", module) and not any(True for _ in module.parameters()):
        raise TypeError(
            f"{type(module).__name__} has no parameters and does not override configure_model(). Build the model"
            " in configure_model() (preferred: ThreeDStrategy then builds it on the meta device and materializes"
            " only this rank's part) or in __init__."
        )
    if config.pipeline_parallel_size > 1 and not module.automatic_optimization:
        raise ParallelConfigError(
            "pipeline_parallel_size > 1 runs backward inside the pipeline schedule, which manual"
            " optimization (self.manual_backward) cannot drive. Use automatic optimization, or pp=1."
        )
    if config.model_init in ("meta", "fast") and built_eagerly:
        raise ParallelConfigError(
            f"model_init={config.model_init!r} needs the model built in configure_model(), but"
            f" {type(module).__name__} already"
            " has parameters from __init__. Move their construction to configure_model(), or use"
            " model_init='auto'."
        )


def check_backend(backend: str, device: torch.device) -> None:
    if backend == "nccl" and device.type != "cuda":
        raise ParallelConfigError(
            f"process_group_backend='nccl' needs CUDA devices, but this run is on {device.type!r}. Use 'gloo'"
            " (the default on CPU), or accelerator='gpu'."
        )
