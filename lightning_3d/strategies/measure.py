"""What ``layout="auto"`` measures on the ranks before it decides, for the config at hand: which
timings of ``strategies/calibrate.py`` (compute), ``strategies/calibrate_optimizer.py`` (the optimizer's step)
and ``strategies/calibrate_links.py`` (communication) run, at which micro-batch sizes and tensor-parallel sizes, gathered into the planner's :class:`Calibration`.
``strategies/auto_layout.py`` decides with it."""

from __future__ import annotations

from typing import Any

import torch

from lightning_3d.common import divisors
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner.calibration import Calibration
from lightning_3d.planner.model import ModelSpec
from lightning_3d.planner.time import DDP_BUCKET_BYTES
from lightning_3d.strategies import calibrate, calibrate_links, calibrate_optimizer, calibrate_timing
from lightning_3d.strategies.calibrate_timing import FP32, RunPrecision


def measure(config: ParallelConfig, *, module, spec: ModelSpec, blocks: list[str], tp_plans: dict, batch: Any,
            batch_size: int, world_size: int, per_node: int, device: torch.device,
            precision: RunPrecision = FP32) -> Calibration:
    """The calibration of these devices for this model and batch, the same on every rank (each timing keeps the
    slowest rank's numbers). ``blocks``: the policy's blocks, as the run wraps them (the first is timed);
    ``tp_plans``: the policy's plan at each tp size to time it split by; ``batch``: the first training batch,
    ``batch_size`` its sequences; ``precision``: the run's (:meth:`RunPrecision.of` its Lightning flag), which
    every compute timing -- blocks, head, optimizer -- runs in. Collective."""
    block_name = blocks[0]
    block = module.get_submodule(block_name)
    call = calibrate.capture_block_call(module, block, batch, module.training_step)
    sizes = sorted({m for m in divisors(batch_size) if m <= 16} | {batch_size}, key=int)[:6]
    cores = calibrate.host_cores_per_rank(per_node, device)
    repeat_s = calibrate_timing.repeat_seconds(cores)
    # Random weights and inputs for the timing, drawn from forked generators: the run's are left as they were.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        # Every timing below counts each repetition at its slowest rank: every rank gets the same numbers.
        block_s = calibrate.block_seconds_per_token(block, call, batch_size, sizes, device, repeat_s,
                                                    precision=precision)
        tp_block_s = calibrate.tp_block_seconds_per_token(block_name, block, tp_plans, call, batch_size,
                                                          sorted({sizes[0], sizes[-1]}), device, repeat_s,
                                                          precision=precision)
        head_s = calibrate.head_seconds_per_token(spec.hidden_size, spec.vocab_size, min(sizes) * spec.seq_length,
                                                  device, repeat_s, precision=precision)
        tp_head_s = {}
        if config.vocab_parallel_loss:  # else the head's logits are gathered whole: the block-like split is off
            tp_head_s = calibrate.tp_head_seconds_per_token(spec.hidden_size, spec.vocab_size, spec.seq_length,
                                                            sorted({sizes[0], sizes[-1]}), sorted(tp_plans), device,
                                                            repeat_s, precision=precision)
        optimizer_s = calibrate_optimizer.optimizer_seconds_per_parameter(block, device, repeat_s,
                                                                          precision=precision)
        embedding_optimizer_s = calibrate_optimizer.embedding_optimizer_seconds_per_parameter(
            spec.vocab_size, spec.hidden_size, device, repeat_s, precision=precision)
        dtensor_s = calibrate_optimizer.dtensor_optimizer_seconds_per_block(block, device, repeat_s,
                                                                            precision=precision)
        dtensor_sharded_s = None
        if world_size > 1:
            dtensor_sharded_s = calibrate_optimizer.dtensor_optimizer_seconds_per_block(block, device, repeat_s,
                                                                                        sharded=True,
                                                                                        precision=precision)
        fsdp_s = 0.0
        if world_size > 1 and config.data_parallel_size != 1:  # a layout may have dp > 1
            fsdp_s = calibrate.fsdp_block_call_seconds(block, call, batch_size, sizes[0], device, repeat_s,
                                                       precision=precision)
        split = {}
        if _zero_bubble_possible(config):
            split = calibrate.zero_bubble_split_seconds_per_token(block, call, batch_size,
                                                                  sorted({sizes[0], sizes[-1]}), device, repeat_s,
                                                                  precision=precision)
        recompute = None
        if config.activation_checkpointing is not None:  # "auto", or a mode the user fixed
            recompute = calibrate.recompute_share(block, call, batch_size, sizes[-1], block_s[sizes[-1]], device,
                                                  repeat_s, precision=precision)
    message_bytes = calibrate_links.message_sizes(largest_message_bytes(module, blocks, batch_size, spec))
    links = calibrate_links.link_speeds(world_size, per_node, device, message_bytes)
    pipeline_s = 0.0
    if "pipeline_parallel_size" in config.auto_fields or config.pipeline_parallel_size > 1:
        pipeline_s = calibrate_links.pipeline_microbatch_seconds(world_size, spec.hidden_size,
                                                                 min(sizes) * spec.seq_length, device, links["pp"],
                                                                 repeat_s)
    ddp_s = None
    if _data_parallel_only(config, world_size, zero=(0,)):
        shapes = [p.shape for p in module.parameters() if p.requires_grad]
        ddp_s = calibrate_links.ddp_sync_seconds_per_byte(shapes, device)
    zero_s = {}
    for stage in (2, 3):
        if _data_parallel_only(config, world_size, zero=(1, 2) if stage == 2 else (3,)):
            zero_s[stage] = calibrate_links.zero_sync_seconds_per_byte(
                _unit_shapes(module, blocks), device, reshard_after_forward=stage == 3)
    return Calibration.from_measurements(
        block_s, head_s, links, tp_block_seconds_per_token=tp_block_s, host_cores_per_rank=cores,
        optimizer_seconds_per_parameter=optimizer_s or None, pipeline_microbatch_s=pipeline_s,
        optimizer_seconds_per_embedding_parameter=embedding_optimizer_s or None,
        optimizer_dtensor_seconds_per_block=dtensor_s, fsdp_block_call_s=fsdp_s, tp_head_seconds_per_token=tp_head_s,
        recompute_share=recompute, ddp_sync_seconds_per_byte=ddp_s, zero2_sync_seconds_per_byte=zero_s.get(2),
        zero3_sync_seconds_per_byte=zero_s.get(3), optimizer_dtensor_seconds_per_sharded_block=dtensor_sharded_s,
        zero_bubble_split_seconds_per_token=split)


def largest_message_bytes(module, blocks: list[str], batch_size: int, spec: ModelSpec) -> int:
    """The largest message a layout of this run may send, in fp32 bytes (gradients are reduced in fp32): one
    FSDP unit's all-gather or reduce-scatter (a block's parameters, or the rest of the model's), a DDP bucket
    (the gradients, up to its 25 MiB), or the activations of the per-replica batch (a tp all-reduce, a pipeline
    send)."""
    units = [4 * sum(shape.numel() for shape in shapes) for shapes in _unit_shapes(module, blocks)]
    activations = 4 * batch_size * spec.seq_length * spec.hidden_size
    return max(*units, min(sum(units), DDP_BUCKET_BYTES), activations)


def _zero_bubble_possible(config: ParallelConfig) -> bool:
    """Whether a layout the config leaves open runs the zero-bubble schedule (over more than one stage)."""
    return config.pipeline_schedule in ("auto", "zero_bubble") and config.pipeline_parallel_size != 1


def _data_parallel_only(config: ParallelConfig, world_size: int, zero: tuple[int, ...]) -> bool:
    """Whether a layout the config leaves open has data parallelism over the whole world, without tp or pp, at
    one of the ``zero`` stages (0: DistributedDataParallel)."""
    return world_size > 1 and (config.zero_stage == "auto" or config.zero_stage in zero) and all(
        getattr(config, name) in ("auto", plain) for name, plain in (
            ("tensor_parallel_size", 1), ("pipeline_parallel_size", 1), ("data_parallel_size", world_size)))


def _unit_shapes(module, blocks: list[str]) -> list[list[torch.Size]]:
    """The trainable parameter shapes of each FSDP unit the strategy makes: each of the policy's ``blocks``, then
    the rest of the model (the root's own)."""
    modules = [module.get_submodule(name) for name in blocks]
    in_blocks = {id(p) for block in modules for p in block.parameters()}
    units = [[p.shape for p in block.parameters() if p.requires_grad] for block in modules]
    return units + [[p.shape for p in module.parameters() if p.requires_grad and id(p) not in in_blocks]]
