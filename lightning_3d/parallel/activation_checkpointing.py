"""Activation checkpointing: keep only each block's input in forward and recompute the rest in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint

from lightning_3d.pipeline.split import held_modules
from lightning_3d.policies.base import Plan, PolicyError

SELECTIVE_EVERY = 2
"""``activation_checkpointing="selective"`` checkpoints every second block: about half the saved activations
for about half the recompute."""


def apply_activation_checkpointing(module: nn.Module, plan: Plan, mode: str) -> None:
    """Checkpoint the plan's blocks that ``module`` holds: all of them ("full") or every second one
    ("selective", counted over the whole model so every layout checkpoints the same blocks).

    PyTorch's composable ``checkpoint`` adds hooks to the block and leaves its names alone (no wrapper
    module), so parameter names stay the single-device ones. It runs before materialization (on meta)."""
    if plan.sharded_rng_regions:
        # The recompute restores the default random stream but not the tp-rank stream, so dropout in a
        # sharded region would draw other masks in backward than in forward.
        raise PolicyError(
            "activation_checkpointing with dropout under tensor parallelism is not supported yet: the"
            " recompute would draw other dropout masks. Set the model's dropout to 0, or activation_checkpointing=None."
        )
    held = held_modules(module, plan.blocks)
    for index, fqn in enumerate(plan.blocks):
        if fqn in held and (mode == "full" or index % SELECTIVE_EVERY == SELECTIVE_EVERY - 1):
            checkpoint(held[fqn])
