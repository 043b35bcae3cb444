"""Turn the single-device model into this rank's part of the parallel model, in one fixed order."""

from __future__ import annotations

import copy
import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_3d.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_3d.parallel.rng import SHARDED_SEED_OFFSET, ShardedRNG, apply_sharded_rng
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel, check_tp_plan
from lightning_3d.parallel.tied import retie
from lightning_3d.parallel.weight_init import broadcast_from_rank0, check_replayable, is_on_meta, replay_init
from lightning_3d.pipeline.split import split_stages
from lightning_3d.policies.base import Plan

log = logging.getLogger(__name__)


class Prepared(NamedTuple):
    init: str
    """"meta" or "exact" (``lightning_3d.parallel.weight_init``)."""
    stages: list[nn.Module]
    """This rank's pipeline stages (empty without pipeline parallelism)."""
    sharded_rng: ShardedRNG | None
    """This tp rank's random stream (None without tensor parallelism); checkpoints save its state."""
    tied_copies: list[str]
    """FQNs of this rank's copies of tied parameters whose partner another pipeline stage holds."""


def prepare_model(module: nn.Module, plan: Plan, mesh: DeviceMesh, device: torch.device,
                  init_rng_state: Tensor | None, stage_blocks: list[list[str]] | None = None,
                  stage_ids: list[int] = (), activation_checkpointing: str | None = None,
                  params_loaded: bool = False, reset_order: list[str] | None = None) -> Prepared:
    """Apply the model-parallel steps of ``plan`` to ``module`` in place and give it its initial weights.

    Collective: every rank of the world calls it. Returns the init used, "meta" or "exact" (see
    ``lightning_3d.parallel.weight_init``), this rank's pipeline stage modules (none without pipeline
    parallelism) and its tp-rank random stream (None without tensor parallelism). The order:

    0. pipeline split (``stage_blocks``: the blocks of every stage; ``stage_ids``: this rank's stages) --
       ``module`` keeps this rank's part under the single-device names;
    1. tensor parallel (``plan.tp_plan`` on the "tp" sub-mesh) -- on the meta device when the model is
       there, so a rank only ever allocates its shards -- and the tp-rank random stream for the plan's
       sharded regions; tied parameters (``plan.tied_parameters``) tied again where one rank holds both;
    2. activation checkpointing of the plan's blocks ("full" or "selective");
    3. materialize and initialize: replay ``reset_parameters()`` from ``init_rng_state`` in ``reset_order``
       (meta; only the
       buffers when ``params_loaded``: ``init_from`` fills the parameters next), or keep rank 0's eagerly
       built weights, broadcast before any sharding (exact).

    Data parallel comes after, in ``lightning_3d.parallel.data_parallel``: it wraps what this produced (the
    module, or each pipeline stage).
    """
    on_meta = is_on_meta(module)
    # Every rank continues rank 0's random stream (they differ if the user did not seed): the same initial
    # weights, and the same dropout masks where data is replicated (lightning_3d.parallel.rng).
    rank0 = _from_rank0({"init": init_rng_state if init_rng_state is not None else torch.get_rng_state(),
                         "now": torch.get_rng_state(), "seed": torch.initial_seed()})
    torch.set_rng_state(rank0["now"])
    if on_meta:
        check_replayable(module, plan.init_module, params_loaded)
        # The unsharded skeleton to replay the init on: deep copies of the (meta, so free) children.
        skeleton = nn.ModuleDict({name: copy.deepcopy(child) for name, child in module.named_children()})
    else:
        broadcast_from_rank0(module)

    if plan.tp_plan:
        check_tp_plan(module, plan.tp_plan, mesh["tp"].size())  # on the whole model, before any split
    stages = split_stages(module, plan, stage_blocks, list(stage_ids)) if stage_blocks else []
    sharded_rng = None
    if plan.tp_plan:
        apply_tensor_parallel(module, plan, mesh["tp"])
        sharded_rng = ShardedRNG(rank0["seed"] + SHARDED_SEED_OFFSET + mesh["tp"].get_local_rank(), device)
        apply_sharded_rng(module, plan.sharded_rng_regions, sharded_rng)

    tied_copies = retie(module, plan.tied_parameters)

    if activation_checkpointing:
        apply_activation_checkpointing(module, plan, activation_checkpointing)

    if on_meta:
        module.to_empty(device=device)
        replay_init(skeleton, module, rank0["init"], plan.init_module, params_loaded, reset_order)
    module.to(device)
    return Prepared("meta" if on_meta else "exact", stages, sharded_rng, tied_copies)



def _from_rank0(obj: dict) -> dict:
    """Rank 0's object, for every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
