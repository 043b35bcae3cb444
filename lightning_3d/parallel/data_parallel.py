"""Data parallel over the "dp" mesh dimension: replicated weights (zero_stage=0) or ZeRO shards (1, 2, 3)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel

from lightning_3d.parallel.precision import allreduce_in


def apply_data_parallel(module: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh,
                        device: torch.device, pipeline_stage: bool = False, zero_stage: int = 0,
                        mp_policy: MixedPrecisionPolicy | None = None,
                        offload_policy: OffloadPolicy | None = None,
                        experts: tuple[list[nn.Module], DeviceMesh] | None = None) -> nn.Module:
    """Replicate (``zero_stage=0``) or shard (1, 2, 3) ``module`` over ``dp_mesh``; return the module
    Lightning should call. ``mp_policy`` and ``offload_policy`` apply to sharded modules only.

    ``experts``: under expert parallelism, the experts modules (split over "ep") and the mesh of the ranks that
    hold the same experts ("dp_mod_ep"). They are replicated or sharded over that mesh first (their gradients
    averaged over it: each is its ep group's average already, ``lightning_3d.parallel.expert_parallel``), and
    ``module`` and its blocks then leave their weights to them.

    Replicated, plain parameters (no tensor parallelism): PyTorch's ``DistributedDataParallel``, returned
    as a wrapper. Its bucketed gradient all-reduce, overlapped with backward, is the fastest replicated data
    parallel PyTorch has (FSDP2's ``replicate`` steps the optimizer on DTensors, whose per-tensor dispatch
    dominates for small tensors), and it is what Lightning's ``DDPStrategy`` runs, so a
    data-parallel run trains exactly like one there. The weights are already equal on every dp rank
    (``lightning_3d.parallel.weight_init``), so DDP's start-up broadcast is skipped.

    Replicated, DTensor parameters (tensor parallel), or a pipeline stage: DDP cannot reduce DTensors, and
    several DDP instances on one rank (interleaved pipeline stages) break its bucket rebuilding across
    micro-batches; FSDP2's ``replicate`` handles both (on the 2D (dp, tp) mesh for DTensors), and is what
    ``torch.distributed.pipelining`` drives.

    Sharded: see :func:`apply_zero`. FSDP2 modules (``replicate`` and ``fully_shard``) are applied in place
    to each of ``blocks`` (submodules of ``module``) first, then to the module, so each block's gradient
    reduction starts as soon as its backward is done.
    """
    if zero_stage > 0:
        if experts is not None:
            modules, mesh = experts
            apply_zero_units(modules, mesh, zero_stage, pipeline_stage, mp_policy, offload_policy)
        return apply_zero(module, blocks, dp_mesh, zero_stage, pipeline_stage, mp_policy, offload_policy)
    wide = mp_policy.reduce_dtype if mp_policy is not None else None  # the reductions' dtype, if set
    if pipeline_stage or any(isinstance(p, DTensor) for p in module.parameters()):
        # Replicated weights compute as they are (autocast casts them under "bf16-mixed"); only the reductions
        # take the policy's dtype.
        reductions = MixedPrecisionPolicy(reduce_dtype=wide)
        if experts is not None:
            modules, mesh = experts
            for unit in modules:
                replicate(unit, mesh=mesh, mp_policy=reductions)
        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=reductions)
        replicate(module, mesh=dp_mesh, mp_policy=reductions)
        return module
    ddp = DistributedDataParallel(
        module,
        device_ids=None if device.type == "cpu" else [device.index],
        process_group=dp_mesh.get_group(),
        init_sync=False,
    )
    if wide is not None and any(p.dtype != wide for p in module.parameters() if p.requires_grad):
        ddp.register_comm_hook(dp_mesh.get_group(), allreduce_in(wide))  # bf16 gradients averaged in fp32
    return ddp


def apply_zero(module: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero_stage: int,
               pipeline_stage: bool = False, mp_policy: MixedPrecisionPolicy | None = None,
               offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """ZeRO over ``dp_mesh`` with FSDP2's ``fully_shard``, per block and then on ``module``, in place.

    Every stage keeps the parameters, their gradients and the optimizer state sharded over dp at rest
    (between steps): the optimizer steps on this rank's shards (DTensors), gradients are reduce-scattered,
    parameters all-gathered before use. Tensor-parallel parameters (DTensors on "tp") get shards on the 2D
    (dp, tp) mesh. The stages differ in how long gathered parameters live within a step:

    * **3** -- each block's parameters are freed after its forward and gathered again for its backward
      (``reshard_after_forward=True``): at most one block is gathered at a time, one more all-gather per
      block and step.
    * **2** -- gathered from a block's forward until its backward (``reshard_after_forward=False``).
    * **1** -- served by stage 2's mechanics. FSDP2 has no optimizer-only sharding; stage 2 also shards the
      gradients, so it never holds more memory than ZeRO-1 would, and its reduce-scatter plus all-gather
      move the same bytes as ZeRO-1's all-reduce. A separate ZeRO-1 (replicated gradients, sharded
      optimizer) would only cost memory.

    Under pipeline parallelism (``pipeline_stage``) every stage takes ``reshard_after_forward=False``, as
    torchtitan does: a stage runs forward for several micro-batches before their backwards, and resharding
    after each would all-gather the stage's parameters once per micro-batch instead of once per step. The
    schedule also keeps them gathered through the backwards and reduce-scatters the gradients once, after
    the last micro-batch (or per micro-batch, ``lightning_3d.pipeline.grad_sync``), then frees them: under
    the pipeline the three stages run alike. :func:`zero_stage_that_runs` says which stage runs.
    """
    apply_zero_units([*blocks, module], dp_mesh, zero_stage, pipeline_stage, mp_policy, offload_policy)
    return module


def apply_zero_units(units: list[nn.Module], dp_mesh: DeviceMesh, zero_stage: int, pipeline_stage: bool = False,
                     mp_policy: MixedPrecisionPolicy | None = None,
                     offload_policy: OffloadPolicy | None = None) -> None:
    """FSDP2's ``fully_shard`` on each of ``units`` in turn (inner ones first), as :func:`apply_zero` describes."""
    reshard = zero_stage_that_runs(zero_stage, pipeline_stage)[0] == 3
    options = dict(mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy or MixedPrecisionPolicy(),
                   offload_policy=offload_policy or OffloadPolicy(), shard_placement_fn=zero_placement)
    for unit in units:
        fully_shard(unit, **options)


def zero_placement(param: nn.Parameter) -> Shard | None:
    """Where ZeRO cuts ``param`` over dp: dim 1 for a weight whose tp split on dim 0 is strided (a fused
    ``q|k|v`` or ``gate|up``), else FSDP2's default (dim 0).

    A dp cut on the dim a strided tp split already cuts nests two strided splits, which DTensor describes
    but does not gather (``full_tensor``) or place (``distribute_tensor``, and so checkpoints) as FSDP2 lays
    them out: the trained values are right and every saved or gathered one of them wrong. On dim 1 the two
    cuts are independent."""
    if isinstance(param, DTensor) and param.ndim >= 2 and any(
            isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def zero_stage_that_runs(zero_stage: int, pipeline: bool) -> tuple[int, str]:
    """The ZeRO stage :func:`apply_zero` runs for ``zero_stage`` (with or without a pipeline), and why it is
    another one where it is ("" where not). The planner models the stage that runs.

    Example::

        zero_stage_that_runs(1, pipeline=False)  # (2, "FSDP2 has no optimizer-only sharding; ...")
    """
    if zero_stage == 1:
        return 2, ("FSDP2 has no optimizer-only sharding; stage 2 also shards the gradients, so it holds no more"
                   " memory and moves the same bytes")
    if zero_stage == 3 and pipeline:
        return 2, ("under the pipeline a stage keeps its parameters gathered from the first micro-batch's forward"
                   " to the last one's backward, instead of gathering them again for each micro-batch")
    return zero_stage, ""
