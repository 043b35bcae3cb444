"""Turn the single-device model into this rank's part of the parallel model: one chain, in one fixed order.

``parallelize`` is the only place the appliers are called. Each step is one call, gated on the layout or the
config, in the order the comment above it explains; it returns one :class:`ParallelModel` that the strategy
keeps. Data flows one way: ``ParallelConfig`` -> ``ParallelDims`` / mesh -> the policy's ``Plan`` -> here ->
the pipeline engine.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_3d.checkpoint.pretrained import load_pretrained
from lightning_3d.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_3d.parallel.balancing_loss import apply_global_balancing_loss
from lightning_3d.parallel.clip import mark_whole_parts
from lightning_3d.parallel.compile import apply_compile
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.context_parallel import ContextParallel, apply_context_parallel, context_parallel_attention
from lightning_3d.parallel.data_parallel import apply_data_parallel
from lightning_3d.parallel.dims import ParallelDims, RankCoords
from lightning_3d.parallel.expert_parallel import apply_expert_parallel, check_expert_parallel
from lightning_3d.parallel.loss import vocab_parallel_loss
from lightning_3d.parallel.sharded_logits import whole
from lightning_3d.parallel.precision import mixed_precision_policy, offload_policy
from lightning_3d.parallel.rng import SHARDED_SEED_OFFSET, ShardedRNG, apply_sharded_rng, preserved_random_state
from lightning_3d.parallel.sequence_length import check_sequence_length, guard_sequence_lengths
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel, check_tp_plan, reduce_partial_grads
from lightning_3d.parallel.tied import TiedGradients, embedding_group, retie
from lightning_3d.parallel.init_tape import InitTape
from lightning_3d.parallel.weight_init import (WeightSource, broadcast_from_rank0, check_replayable, fill_seeded,
                                              is_on_meta, materialize, replay_init, seed_of, stream_from_rank0)
from lightning_3d.pipeline.engine import PipelineEngine
from lightning_3d.pipeline.shared_results import awaits_results
from lightning_3d.pipeline.random_replay import state_bytes, state_tensor
from lightning_3d.pipeline.split import assign_blocks, check_splittable, held_modules, split_options, split_stages, stage_ids_of
from lightning_3d.policies import Policy
from lightning_3d.policies.auto_pipeline import with_pipeline
from lightning_3d.policies.base import Plan, PlanOptions


@dataclass(frozen=True)
class InitialWeights:
    """Where the weights come from when the model was built on the meta device (``parallel.weight_init``)."""

    rng_state: Tensor | None
    """The host random state ``configure_model()`` started from: the init is replayed from it."""
    reset_order: list[str] | None = None
    """Module FQNs in the order the build initialized them (``parallel.init_record``); None: construction order."""
    streamed: bool = False
    """The weights are global rank 0's build as written, streamed tensor by tensor into every rank's shards
    (``weight_init.stream_from_rank0``) instead of replayed module by module: the exact route for a meta build
    whose init cannot be replayed that way."""
    source: WeightSource | None = None
    """On global rank 0 when ``streamed``: that build's tensors, by the LightningModule's names (a recorded
    build replayed op by op, ``parallel.init_tape``, or a host build)."""
    seeded: InitTape | None = None
    """``model_init="fast"``: the build recorded on the meta device, which every rank replays for its own
    tensors only, on its device, each draw seeded apart (``InitTape.seeded_tensors``): not the numbers of the
    build as written, but the same at every layout."""


@dataclass(frozen=True)
class ParallelModel:
    """What :func:`parallelize` made of the model on this rank."""

    module: nn.Module
    """The LightningModule, holding this rank's part under the single-device names."""
    called: nn.Module
    """What Lightning calls: the data-parallel wrapper (DDP) or ``module`` itself (FSDP2 works in place; under
    pipeline parallelism the engine calls the stages)."""
    engine: PipelineEngine | None
    """The micro-batch engine over this rank's stages; None without pipeline parallelism."""
    sharded_rng: ShardedRNG | None
    """This tp rank's random stream (None without tensor parallelism); checkpoints save its state."""
    loss_context: Callable[[], AbstractContextManager]
    """Entered around steps and backward: the vocabulary-parallel cross-entropy under tensor parallelism."""
    step_result: Callable[[Any], Any] | None = None
    """What a step's result goes through before Lightning sees it (its vocabulary-sharded logits made whole);
    None: kept as it is."""


def parallelize(module: nn.Module, plan: Plan, config: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh, *,
                rank: int, device: torch.device, precision: Precision, weights: InitialWeights) -> ParallelModel:
    """Apply ``plan`` to ``module`` in place for global rank ``rank`` of the ``dims`` layout, give it its initial
    weights, and wrap it for data and pipeline parallelism.

    Collective: every rank of the world calls it, in the same order. Example (what the strategy's ``setup``
    does)::

        model = parallelize(module, plan, config, dims, mesh, rank=rank, device=device,
                            precision=precision_plugin, weights=InitialWeights(rng_state))
        model.engine  # the pipeline engine under pp > 1
    """
    coords = dims.coords(rank)
    # What the plan cannot do to this model fails first, the same on every rank, before any collective.
    stage_blocks = []  # the blocks of every pipeline stage
    if dims.pp > 1:
        check_splittable(module, plan)
        stage_blocks = assign_blocks(plan.blocks, dims.pp * config.virtual_pipeline_size,
                                     **split_options(module, plan, config.pipeline_split))
    if plan.tp_plan:
        check_tp_plan(module, plan.tp_plan, dims.tp)  # on the whole model, before any split
    if dims.ep > 1:
        check_expert_parallel(module, plan, dims.ep)
    params_loaded = config.init_from is not None  # init_from fills the parameters: only buffers are initialized
    on_meta = is_on_meta(module)
    if on_meta and not weights.streamed and weights.seeded is None:
        check_replayable(module, plan.init_module, params_loaded)
    # Every rank continues rank 0's random stream (they differ if the user did not seed): the same initial
    # weights, and the same dropout masks where data is replicated (lightning_3d.parallel.rng).
    init_state = weights.rng_state if weights.rng_state is not None else torch.get_rng_state()
    rank0 = _from_rank0({"init": state_bytes(init_state), "now": state_bytes(torch.get_rng_state()),
                         "seed": torch.initial_seed()})
    torch.set_rng_state(state_tensor(rank0["now"]))
    if on_meta:
        # The unsharded skeleton to replay the init on: deep copies of the (meta, so free) children.
        skeleton = nn.ModuleDict({name: copy.deepcopy(child) for name, child in module.named_children()})
    else:  # exact: rank 0's weights, before any sharding
        broadcast_from_rank0(module)

    # 1. Pipeline split first: a rank then only ever holds (and shards, and allocates) its own stages' blocks,
    #    under the single-device names.
    stages: dict[int, nn.Module] = {}
    if stage_blocks:
        stage_ids = stage_ids_of(coords.pp, dims.pp, config.virtual_pipeline_size)
        stages = dict(zip(stage_ids, split_stages(module, plan, stage_blocks, stage_ids)))
        rank_zero_info(f"lightning_3d: pipeline of {len(stage_blocks)} stages, blocks per stage"
                       f" {[len(b) for b in stage_blocks]}, schedule {config.pipeline_schedule!r},"
                       f" {config.microbatches} micro-batches")

    # 2. Expert parallel: this rank's experts of each mixture-of-experts layer it holds, placed on "ep" (and on
    #    "tp" as the tp plan splits them), their calls routed by all-to-all; then tensor (and sequence) parallel
    #    on the "tp" sub-mesh, whose experts style wraps that routing. Still on the meta device when the model is
    #    there, so a rank allocates only its shards; and the tp rank's own dropout stream for sharded regions.
    held = held_modules(module, plan.blocks)
    experts = [name for name in plan.experts if any(name.startswith(f"{block}.") for block in held)]
    if dims.ep > 1:
        apply_expert_parallel(module, experts, plan.tp_plan, mesh)
    sharded_rng = None
    if plan.tp_plan:
        apply_tensor_parallel(module, plan, mesh["tp"])
        sharded_rng = ShardedRNG(rank0["seed"] + SHARDED_SEED_OFFSET + mesh["tp"].get_local_rank(), device)
        apply_sharded_rng(module, plan.sharded_rng_regions, sharded_rng)
    if config.sequence_parallel and not stages:  # (under pp the engine checks the inputs it captures)
        guard_sequence_lengths(module, plan.tp_plan, dims.tp)

    # 3. Tied weights (embedding and head) tied again where this rank holds both ends; the FQNs of the ends
    #    whose partner another stage holds.
    tied_copies = retie(module, plan.tied_parameters)

    # 4. Activation checkpointing of the blocks, then torch.compile of each block (over its tp shards and its
    #    checkpoint, as torchtitan orders them), before data parallel wraps them (parallel/compile.py).
    if config.activation_checkpointing:
        apply_activation_checkpointing(module, plan, config.activation_checkpointing)
    # 4b. Context parallel: the blocks run on this rank's part of each sequence (its inputs cut, the last
    #     block's output gathered; between pipeline stages the part travels). Its hooks come after activation
    #     checkpointing's, so a checkpoint keeps the block's inputs as they came and its recompute cuts them
    #     again, as the forward did.
    context = None
    if dims.cp > 1:
        context = ContextParallel(group=mesh["cp"].get_group(), cp=dims.cp, rank=coords.cp,
                                  sequence_parallel=mesh["tp"].get_group() if config.sequence_parallel else None)
        apply_context_parallel(held_modules(module, plan.blocks), context, first=plan.blocks[0], last=plan.blocks[-1],
                               stage_starts={blocks[0] for blocks in stage_blocks[1:]})
    # 4c. A router's load-balancing loss (a mixture of experts') over the global batch: its statistics gathered
    #     from the ranks that hold other tokens, as one process computes it on the whole batch.
    if dims.replicas > 1:
        apply_global_balancing_loss(module, dims.replicas_mesh(mesh).get_group())
    if config.compile:
        apply_compile(module, plan, rank)

    # 5. Under ZeRO/HSDP with the model on the meta device: precision and data parallel (7, 8) come first, so
    #    FSDP2 shards the meta tensors and a rank then allocates and initializes its dp shard only, never the
    #    unsharded tp/pp share (torchtitan's order). Otherwise the weights are initialized first (6): DDP and
    #    FSDP2's replicate take real tensors.
    blocks = list(held_modules(module, plan.blocks).values())  # this rank's blocks: FSDP2's units
    data_parallel = partial(_data_parallel, blocks=blocks, experts=[module.get_submodule(e) for e in experts],
                            config=config, dims=dims, mesh=mesh, device=device, precision=precision)
    shard_first = on_meta and shards_over_dp(config, dims)
    if shard_first:
        precision.convert_module(module)
        stages = {i: data_parallel(stage) for i, stage in stages.items()}
        called = module if stages else data_parallel(module)

    # 6. Initial weights: materialize this rank's tensors (its shards) and replay reset_parameters() on them
    #    (meta), or fill them from rank 0's build as written, one full tensor at a time (exact, streamed), or
    #    replay the recorded build for this rank's tensors only, each draw seeded apart (fast), or keep the
    #    broadcast weights (exact, built on every rank).
    if on_meta:
        materialize(module, device)
        if weights.seeded is not None:
            fill_seeded(module, weights.seeded, device, seed_of(rank0["init"]))
        elif weights.streamed:
            stream_from_rank0(skeleton, module, weights.source, device)
            # A replay of the build on rank 0 left its generator where the build as written leaves it.
            torch.set_rng_state(state_tensor(_from_rank0({"now": state_bytes(torch.get_rng_state())})["now"]))
        else:
            replay_init(skeleton, module, state_tensor(rank0["init"]), plan.init_module, params_loaded,
                        weights.reset_order)
    # (on sharded modules FSDP2 takes the materialized shards in here: its _apply re-reads them)
    module.to(device)
    init = "fast" if weights.seeded is not None else "exact" if weights.streamed or not on_meta else "meta"
    rank_zero_info(f"lightning_3d: model_init={init!r} (see lightning_3d.parallel.weight_init)")

    if not shard_first:
        # 7. Precision: Lightning's plugin converts the weights ("bf16-true") before data parallel shards them.
        precision.convert_module(module)
        # 8. Data parallel over "dp" (replicated or ZeRO shards): around the module, or around each stage.
        stages = {i: data_parallel(stage) for i, stage in stages.items()}
        called = module if stages else data_parallel(module)

    # 9. Pretrained weights over the initialized ones: after data parallel, so a rank reads only the slices it
    #    holds (its tp shard, and under ZeRO-3 its dp shard of that).
    if config.init_from:
        load_pretrained(module, config.init_from, plan.checkpoint_names, plan.tied_parameters)
    mark_whole_parts(module)  # the global norm counts the rows every tp rank holds once

    sharded_logits = dims.tp > 1 and config.vocab_parallel_loss
    loss_context = vocab_parallel_loss if sharded_logits else nullcontext
    if context is not None:
        loss_context = partial(_both, loss_context, partial(context_parallel_attention, context))
    step_result = whole if sharded_logits else None  # logits a step returns reach Lightning whole
    engine = None
    if stages:
        # 10. Tied weights' gradients summed between the first and last stages (built once data parallel has
        #    replaced the parameters), after the tp sums left pending in the schedule's backward.
        tied = (TiedGradients(module, tied_copies, embedding_group(dims, coords))
                if plan.tied_parameters else None)
        # 11. The pipeline engine over this rank's stages.
        engine = PipelineEngine(
            module=module, root_name=plan.pipeline_root, num_stages=len(stage_blocks),
            stages=stages, schedule=config.pipeline_schedule, num_microbatches=config.microbatches,
            pp_group=mesh["pp"].get_group(), device=device,
            # (on a GPU the results' receive is not posted ahead, and a group of their own would be one more NCCL
            # communicator, with its buffers, for nothing: the pp group's)
            results_group=pipeline_results_group(dims, coords) if device.type == "cpu" else None,
            last_stage_rank=dims.rank(coords._replace(pp=dims.pp - 1)), loss_context=loss_context,
            random_state=partial(preserved_random_state, sharded_rng, device), stage_output=plan.stage_output,
            step_result=step_result,
            dp_group=mesh["dp"].get_group(), finish_grads=partial(_finish_grads, dims.tp > 1, tied),
            reduce_grads_per_microbatch=config.pipeline_reduce_grads == "per_microbatch",
            check_inputs=partial(check_sequence_length, tp=dims.tp) if config.sequence_parallel else None,
        )
    return ParallelModel(module=module, called=called, engine=engine, sharded_rng=sharded_rng,
                         loss_context=loss_context, step_result=step_result)


def pipeline_results_group(dims: ParallelDims, coords: RankCoords) -> dist.ProcessGroup:
    """This rank's pipeline (the ranks of its (dp, cp, tp) over pp), as a group of its own for the step's results
    (``pipeline/shared_results.py``: a receive posted there ahead of the step must not meet the schedule's or any
    other collective). Collective: every rank of the world creates every pipeline's, in the same order.

    A new one per pipeline engine, not one per layout: a step that fails after its receive was posted leaves that
    receive waiting on the group for good, and a later fit in the process (a notebook's, a test's) would have it
    take its first results. The previous engine's is destroyed once the new ones exist -- making a gloo group
    connects its members, so they are all past the previous fit -- unless a receive still waits on it there
    (destroying would wait for it): that one is left alive. Nor where the default group it was made under has
    been destroyed since (a process that ends its process groups between fits and starts new ones): it went
    with it."""
    per_stage = dims.world_size // dims.pp  # a pipeline per rank of the first stage (ranks 0 .. per_stage - 1)
    groups = [dist.new_group(dims.group_ranks("pp", first)) for first in range(per_stage)]
    mine = groups[dims.rank(coords) % per_stage]
    for world, previous in _RESULTS_GROUPS:
        if world is dist.group.WORLD and not awaits_results(previous):
            dist.destroy_process_group(previous)
    _RESULTS_GROUPS[:] = [(dist.group.WORLD, mine)]
    return mine


_RESULTS_GROUPS: list[tuple] = []  # (the default group, this rank's results group) of the last engine built


def plan_model(policy: Policy, module: nn.Module, config: ParallelConfig, tp: int) -> Plan:
    """The policy's plan for ``module`` under ``config`` at tensor-parallel size ``tp``, completed for a
    pipeline where it names only its blocks (``policies.auto_pipeline``). Also what the dry run shows."""
    options = PlanOptions(tp=tp, sequence_parallel=config.sequence_parallel,
                          vocab_parallel_loss=config.vocab_parallel_loss, allow_replicated=config.allow_replicated)
    return with_pipeline(module, policy.plan(module, options))


def shards_over_dp(config: ParallelConfig, dims: ParallelDims) -> bool:
    """Whether data parallel is FSDP2's ``fully_shard`` (ZeRO, HSDP): over dp > 1, or over one rank to offload
    (ZeRO-Offload on one GPU keeps parameters, gradients and optimizer state in host memory)."""
    return config.zero_stage > 0 and (dims.replicas > 1 or config.offload)


def _data_parallel(module: nn.Module, *, blocks: list[nn.Module], experts: list[nn.Module], config: ParallelConfig,
                   dims: ParallelDims, mesh: DeviceMesh, device: torch.device, precision: Precision) -> nn.Module:
    # dp = 1 has nothing to replicate or shard over, unless offload asks FSDP2 to keep the state on the host.
    # (Context-parallel ranks hold the same weights as data-parallel ones: both are reduced over, dp x cp.)
    if dims.replicas == 1 and not shards_over_dp(config, dims):
        return module
    inner = [m for m in module.modules() if m is not module and any(m is b for b in blocks)]
    dp_mesh = dims.dp_mesh_for_zero(mesh) if config.zero_stage > 0 else dims.replicas_mesh(mesh)  # HSDP: (replicate, shard)
    # Under expert parallelism the ranks that hold the same experts are one per ep group ("dp_mod_ep").
    experts = ([m for m in module.modules() if any(m is e for e in experts)], mesh["dp_mod_ep"]) if dims.ep > 1 else None
    return apply_data_parallel(module, inner, dp_mesh, device, pipeline_stage=dims.pp > 1,
                               zero_stage=config.zero_stage, mp_policy=mixed_precision_policy(precision, config.reduce_dtype),
                               offload_policy=offload_policy(config, device), experts=experts)


@contextmanager
def _both(first: Callable[[], AbstractContextManager], second: Callable[[], AbstractContextManager]):
    with first(), second():
        yield


def _finish_grads(tp_sums_pending: bool, tied: TiedGradients | None, module: nn.Module) -> None:
    """After the schedule's backward: sums left pending across tp ranks, then the tied weights' copies."""
    if tp_sums_pending:
        reduce_partial_grads(module)
    if tied is not None:
        tied()


def _from_rank0(obj: dict) -> dict:
    """Rank 0's object (numbers and bytes: no tensor is pickled), for every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
