"""``lightning-3d fit --config X --dry_run``: what a run of this config would do, without starting it.

From the objects LightningCLI built (the Trainer's instantiation has already checked that the layout can be
cut from ``num_nodes * devices`` processes, as a real run does at ``Trainer(...)``), in the launching process
and in seconds: the resolved layout, the policy's plan on a meta-device build of the model and the blocks
per pipeline stage, the planner's estimate of each rank's memory, and the checks and warnings each rank of a
real run would give before its first collective (the same functions, so the same messages). No process
starts, no process group forms, no weight is materialized.

    lightning-3d fit --config example_configs/gpt_tiny_3d_cpu.yaml --dry_run
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from torch import nn

from lightning_3d.checkpoint.pretrained import check_init_from
from lightning_3d.common import parent_fqn
from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.data_parallel import zero_stage_that_runs
from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.parallel.precision import check_precision, warn_about_no_ops
from lightning_3d.pipeline.microbatches import split_batch
from lightning_3d.pipeline.split import assign_blocks, check_splittable, split_options
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, MemoryEstimate, estimate_memory
from lightning_3d.planner.cluster import GIB, Cluster
from lightning_3d.planner.model import model_spec
from lightning_3d.policies import Policy, resolve_policy
from lightning_3d.policies.base import Plan
from lightning_3d.strategies.checks import check_backend, check_model
from lightning_3d.strategies.threads import is_thread_count, local_world_size, threads_per_rank
from lightning_3d.parallel.parallelize import plan_model

MIB = 2**20


def dry_run(trainer: pl.Trainer, module: pl.LightningModule, datamodule: Optional[pl.LightningDataModule]) -> str:
    """The report of a run of ``trainer.fit(module, datamodule)``; raises what a rank would raise before its
    first collective (``ParallelConfigError``, ``PolicyError``, ...), with the same message."""
    from lightning_3d.strategies.three_d import ThreeDStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ThreeDStrategy):
        return f"dry run: the strategy is {type(strategy).__name__}, not ThreeDStrategy; there is no layout to show."
    per_node, device = strategy.num_processes, strategy.parallel_devices[0]
    chosen = []
    if strategy.parallel_config.is_auto:  # the planner's choice on assumed speeds; the run calibrates first
        strategy.parallel_config, chosen = _assumed_choice(trainer, module, datamodule, strategy.parallel_config,
                                                           per_node, device)
    config = strategy.parallel_config
    dims = ParallelDims.from_config(config, per_node * trainer.num_nodes)
    lines = [f"lightning-3d dry run (no process started): {dims}, {per_node} per node x {trainer.num_nodes}"
             f" node(s), on {device.type}",
             *chosen]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy, notes = _rank_checks(strategy, module, dims, device)
        plan = _plan_on_meta(module, policy, config, dims)
        lines.append(f"policy {policy.name or type(policy).__name__}: {_count(module.parameters())} parameters"
                     f" (built on the meta device), {len(plan.blocks)} blocks; {_settings(config, dims)}")
        stages = _stages(module, plan, dims, config)
        lines += _stage_lines(plan, stages, dims)
        lines += _memory_lines(trainer, module, datamodule, dims, config, per_node, device, notes)
    warned = [f"warning: {w.message}" for w in caught]
    lines += ["what a run would also say:" if notes or warned else "no warnings."]
    lines += [f"  {line}" for line in [*notes, *warned]]
    return "\n".join(lines)


def _assumed_choice(trainer, module, datamodule, config: ParallelConfig, per_node: int,
                    device: torch.device) -> tuple[ParallelConfig, list[str]]:
    """layout="auto" in a dry run: the planner's choice without calibration (a run times its devices first, so
    it may choose otherwise), on the datasheet figures of an H100 for GPUs or assumed speeds for CPU ranks."""
    from lightning_3d.strategies.auto_layout import assumed_calibration, host_cluster, ranked, report, values_of

    with torch.device("meta"):
        module.configure_model()
    spec = model_spec(module, _hparam(datamodule, "seq_len"))
    precision = PRECISIONS.get(str(trainer.precision))
    batch = _hparam(datamodule, "batch_size")
    if spec is None or precision is None or batch is None:
        raise ParallelConfigError("layout='auto' in a dry run needs the planner's model of this run from a config"
                                  " (the reference GPT or a Hugging Face model), a known precision and a data module"
                                  " with batch_size; it has none here. A run measures any other model on its first"
                                  " training batch and decides then; to see a layout here, set it explicitly.")
    world = per_node * trainer.num_nodes
    memory = config.max_memory_per_device or _memory_per_rank(device, per_node) or float(2**40)
    cluster, calibration = host_cluster(world, per_node, memory, device.type), None
    if device.type == "cpu":
        calibration = assumed_calibration(spec)
    else:
        cluster = Cluster.preset("h100", gpus_per_node=min(per_node, world), nodes=max(1, world // per_node),
                                 memory_gib=memory / GIB, usable_fraction=1.0)
    candidates = ranked(spec, config, world_size=world, per_node=per_node, batch_size=batch, precision=precision,
                        memory_per_rank=memory, calibration=calibration, cluster=cluster,
                        accumulate=trainer.accumulate_grad_batches)
    text = report(candidates, spec, calibrated=False).replace("lightning_3d: ", "")
    return config.decided(**values_of(candidates[0].layout, config)), text.splitlines()


def _rank_checks(strategy, module: pl.LightningModule, dims: ParallelDims,
                 device: torch.device) -> tuple[Policy, list[str]]:
    """``ThreeDStrategy.setup_environment``'s checks, in its order: the policy, and the notes a run logs."""
    config = strategy.parallel_config
    if config.init_from:
        check_init_from(config.init_from)
    check_precision(strategy.precision_plugin, device, dims, config)
    warn_about_no_ops(config, dims, device)
    policy = resolve_policy(config.policy)
    check_model(module, config)
    check_backend(strategy.process_group_backend or _get_default_process_group_backend_for_device(device), device)
    notes = []
    runs, why = zero_stage_that_runs(config.zero_stage, dims.pp > 1)
    if runs != config.zero_stage and dims.dp > 1:
        notes.append(f"zero_stage={config.zero_stage} runs as ZeRO-{runs}: {why}")
    if device.type == "cpu" and not is_thread_count(os.environ.get("OMP_NUM_THREADS")):  # as a run decides
        local = local_world_size(strategy.num_processes)
        notes.append(f"{threads_per_rank(local)} intra-op thread(s) per rank ({len(os.sched_getaffinity(0))} CPUs"
                     f" // {local} ranks on this host); set OMP_NUM_THREADS to choose another count")
    return policy, notes


def _plan_on_meta(module: pl.LightningModule, policy: Policy, config: ParallelConfig, dims: ParallelDims) -> Plan:
    """The policy's plan, as ``ThreeDStrategy._plan`` makes it, for the model built on the meta device (a model
    built in ``__init__`` is already there)."""
    with torch.device("meta"):
        module.configure_model()
    return plan_model(policy, module, config, dims.tp)


def _settings(config: ParallelConfig, dims: ParallelDims) -> str:
    parts = []
    if dims.pp > 1:
        chunks = f", {config.virtual_pipeline_size} chunks per rank" if config.virtual_pipeline_size > 1 else ""
        parts.append(f"schedule {config.pipeline_schedule!r}{chunks}, {config.microbatches}"
                     " micro-batches")
    if config.sequence_parallel and dims.tp > 1:
        parts.append("sequence parallel")
    if dims.cp > 1:
        parts.append(f"context parallel: each sequence's blocks over {dims.cp} ranks, {2 * dims.cp} load-balanced"
                     " chunks")
    parts.append(f"zero_stage={config.zero_stage}")
    if dims.hsdp:
        parts.append(f"HSDP: ZeRO over {dims.dp_shard} dp ranks, {dims.dp_replicate} replicas")
    if config.compile:
        parts.append("compile=True (its speed is assumed, not modelled: the estimates are eager's)")
    if config.activation_checkpointing:
        parts.append(f"activation_checkpointing={config.activation_checkpointing!r}")
    return ", ".join(parts)


def _stages(module: nn.Module, plan: Plan, dims: ParallelDims, config: ParallelConfig) -> list[list[str]]:
    if dims.pp == 1:
        return [list(plan.blocks)]
    check_splittable(module, plan)
    return assign_blocks(plan.blocks, dims.pp * config.virtual_pipeline_size,
                         **split_options(module, plan, config.pipeline_split))


def _stage_lines(plan: Plan, stages: list[list[str]], dims: ParallelDims) -> list[str]:
    lines = []
    for s, blocks in enumerate(stages):
        pp_rank = s % dims.pp
        extra = [*(plan.before if s == 0 else []), *(plan.after if s == len(stages) - 1 else [])]
        lines.append(f"stage {s} on ranks {_ranks(dims, pp_rank)}: {len(blocks)} blocks {_names(blocks)}"
                     + (f" + {', '.join(extra)}" if extra else ""))
    return lines


def _memory_lines(trainer, module, datamodule, dims, config, per_node, device, notes: list[str]) -> list[str]:
    """Each pipeline rank's estimate from the planner's memory model (every dp and tp rank of a stage holds the
    same amounts), where the planner knows the model and the precision."""
    spec = model_spec(module, _hparam(datamodule, "seq_len"))
    precision = PRECISIONS.get(str(trainer.precision))
    if spec is None or precision is None:
        why = (f"a dry run reads the model's sizes from a config (the reference GPT, Hugging Face), and"
               f" {type(module).__name__} has none; layout='auto' measures it at launch"
               if spec is None else f"the planner models precision {sorted(PRECISIONS)}, not {trainer.precision!r}")
        return [f"memory per rank: not estimated ({why})"]
    batch = _hparam(datamodule, "batch_size")
    if batch is None:
        notes.append("the data module names no batch_size: memory assumes 1 sequence per replica and step")
    m = config.microbatches if dims.pp > 1 else trainer.accumulate_grad_batches
    if dims.pp > 1 and batch is not None:
        split_batch(torch.empty(batch, device="meta"), m)  # the engine's check, at the first step of a run
    micro = max(1, (batch or 1) // m) if dims.pp > 1 else batch or 1
    layout = Layout(dp=dims.dp, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, micro_batch_size=micro,
                    num_microbatches=m,
                    schedule=config.pipeline_schedule, virtual_stages=config.virtual_pipeline_size,
                    sequence_parallel=config.sequence_parallel, zero_stage=config.zero_stage,
                    recompute=config.activation_checkpointing, pipeline_reduce_grads=config.pipeline_reduce_grads,
                    dp_shard=dims.dp_shard if dims.hsdp else 0)
    estimates = [estimate_memory(spec, layout, precision, r) for r in range(dims.pp)]
    if dims.pp > 1 and config.pipeline_split != "blocks":  # the planner splits by count (planner.memory.rank_blocks)
        notes.append(f"the memory estimate splits the blocks evenly by count, not by pipeline_split"
                     f"={config.pipeline_split!r} as the stages above")
    lines = [f"memory per rank (MiB; planner's model of {spec.num_parameters():,} parameters, {precision.name},"
             f" {m} micro-batch(es) of {micro} x {spec.seq_length} tokens):",
             f"  {'ranks':<12}{'parameters':>11}{'gradients':>11}{'optimizer':>11}{'activations':>13}"
             f"{'transient':>11}{'total':>10}"]
    for pp_rank, e in enumerate(estimates):
        lines.append(f"  {_ranks(dims, pp_rank):<12}" + "".join(
            f"{value / MIB:>{width}.2f}" for value, width in zip(_columns(e), (11, 11, 11, 13, 11, 10))))
    capacity = _memory_per_rank(device, per_node)
    if capacity is not None and max(e.total for e in estimates) > capacity:
        notes.append(f"the estimate ({max(e.total for e in estimates) / MIB:,.0f} MiB on the fullest rank) exceeds"
                     f" the {capacity / MIB:,.0f} MiB each of the {per_node} ranks per node has on this machine")
    return lines


def _columns(e: MemoryEstimate) -> tuple[float, ...]:
    return (e.parameters, e.gradients, e.optimizer_state, e.activations, e.gathered, e.total)


def _memory_per_rank(device: torch.device, per_node: int) -> Optional[float]:
    """What one rank may use here: its GPU's memory, or the host's memory shared by the ranks on it."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node
    return None


def _hparam(datamodule: Any, name: str) -> Optional[int]:
    """A data module's saved hyperparameter (``save_hyperparameters()``), else its attribute, else None."""
    hparams = getattr(datamodule, "hparams", None) or {}
    return hparams.get(name, getattr(datamodule, name, None))


def _ranks(dims: ParallelDims, pp_rank: int) -> str:
    """The global ranks of one pipeline rank: a contiguous range, pp being the slowest mesh dimension."""
    per_stage = dims.world_size // dims.pp
    first, last = pp_rank * per_stage, (pp_rank + 1) * per_stage - 1
    return f"{first}" if first == last else f"{first}-{last}"


def _names(fqns: list[str]) -> str:
    """``model.blocks.0-1`` for consecutive numbered siblings, else the names themselves."""
    parents = {parent_fqn(f) for f in fqns}
    numbers = [f.rpartition(".")[2] for f in fqns]
    if len(parents) == 1 and all(n.isdigit() for n in numbers) and numbers:
        first, last = int(numbers[0]), int(numbers[-1])
        if [int(n) for n in numbers] == list(range(first, last + 1)):
            return f"{parents.pop()}.{first}" + (f"-{last}" if last != first else "")
    return ", ".join(fqns)


def _count(params) -> str:
    return f"{sum(p.numel() for p in params):,}"
