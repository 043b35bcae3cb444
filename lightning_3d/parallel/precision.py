"""What FSDP2 takes from Lightning's ``precision=`` flag and from the ``offload`` switch, and the checks on
both (run on every rank before any collective).

Lightning's own precision plugins do the work on every layout; the strategy adds only FSDP2's policies
where parameters are sharded (``zero_stage > 0``):

* ``"32-true"`` -- ``Precision``: fp32 everywhere.
* ``"bf16-mixed"`` -- ``MixedPrecision``: ``torch.autocast`` to bf16 around steps; the weights, their
  gradients and the optimizer state stay fp32 (the master weights). Sharded, FSDP2 also all-gathers the
  parameters as bf16 (half the bytes) and reduce-scatters the gradients in fp32
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); its shards, which the optimizer steps,
  stay fp32.
* ``"bf16-true"`` -- ``HalfPrecision``: the model is converted to bf16 before sharding; no master weights.
  Gradients are reduced over dp in ``ParallelConfig.reduce_dtype`` (fp32 by default, as torchtitan and
  Megatron-LM do): FSDP2's ``reduce_dtype`` where it shards or replicates, a DDP communication hook
  (:func:`allreduce_in`) where DDP replicates.
* ``"16-mixed"`` -- fp16 autocast with Lightning's gradient scaler, on CUDA only, and only where every rank
  holds whole, replicated gradients (tp = pp = 1, zero_stage = 0): the scaler skips a step when *its own*
  gradients overflow, and ranks holding different shards or stages would then disagree about skipping.
  On CPU, Lightning itself turns ``Trainer(precision="16-mixed")`` into "bf16-mixed" with a warning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.dims import ParallelDims

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


def check_precision(plugin: Precision, device: torch.device, dims: ParallelDims, config: ParallelConfig) -> None:
    """Refuse a precision this strategy cannot run on this layout, saying what to use instead."""
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision not in SUPPORTED_PRECISION:
        raise ParallelConfigError(
            f"ThreeDStrategy supports precision in {SUPPORTED_PRECISION}, got {precision!r}"
            f" ({type(plugin).__name__}). Pass Trainer(precision='bf16-mixed') (or '32-true') instead."
        )
    if precision != "16-mixed":
        return
    if device.type != "cuda":
        raise ParallelConfigError(
            f"precision='16-mixed' needs CUDA (fp16 autocast with a gradient scaler), but this run is on"
            f" {device.type!r}. Use precision='bf16-mixed' (or '32-true')."
        )
    if dims.tp > 1 or dims.pp > 1 or config.zero_stage > 0:
        raise ParallelConfigError(
            f"precision='16-mixed' skips a step when a rank's gradients overflow; with tp={dims.tp}, pp={dims.pp},"
            f" zero_stage={config.zero_stage} ranks hold different gradients and would disagree about skipping."
            " Use precision='bf16-mixed' (no gradient scaler needed), or tp=1, pp=1, zero_stage=0."
        )


def mixed_precision_policy(plugin: Precision, reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """FSDP2's policy: under "bf16-mixed" bf16 gathers and compute with fp32 reductions; under "bf16-true" the
    gradients reduced in ``reduce_dtype`` (``ParallelConfig.reduce_dtype``)."""
    precision = getattr(plugin, "precision", None)
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "bf16-true":
        return MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce_dtype))
    return MixedPrecisionPolicy()


def allreduce_in(dtype: torch.dtype):
    """A DDP communication hook that averages each gradient bucket in ``dtype`` (fp32 for bf16 gradients) and
    hands it back in the bucket's own dtype. Register with ``ddp.register_comm_hook(process_group, hook)``."""
    def hook(group, bucket):  # DDP checks the annotations' objects: none, rather than postponed strings
        buffer = bucket.buffer()
        wide = buffer.to(dtype).div_(dist.get_world_size(group))
        work = dist.all_reduce(wide, group=group, async_op=True).get_future()
        return work.then(lambda done: buffer.copy_(done.value()[0]))
    return hook


def warn_about_no_ops(config: ParallelConfig, dims: ParallelDims, device: torch.device) -> None:
    """Say once (rank 0) when a memory switch has nothing to act on in this run."""
    if config.offload and device.type != "cuda":
        rank_zero_warn(
            f"offload=True does nothing on {device.type!r}: parameters and optimizer state already live in host"
            " memory. On CUDA it keeps the sharded parameters, gradients and optimizer state in host memory."
        )
    if config.zero_stage > 0 and dims.dp == 1:
        still = (" offload=True still keeps parameters, gradients and optimizer state in host memory (FSDP2 over"
                 " one rank)." if config.offload else "")
        rank_zero_warn(
            f"zero_stage={config.zero_stage} shards over the data-parallel ranks, but dp=1 (tp={dims.tp},"
            f" pp={dims.pp}): nothing is sharded.{still} Launch a multiple of tp * pp = {dims.tp * dims.pp}"
            " processes above it to get dp > 1."
        )


def offload_policy(config: ParallelConfig, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload of the sharded parameters, gradients and optimizer state when asked, on CUDA:
    the optimizer then steps on the CPU, and each block's parameters are copied to the GPU when gathered."""
    if config.offload and device.type == "cuda":
        # Pinned host memory lets the copies to and from the GPU overlap with compute.
        return CPUOffloadPolicy(pin_memory=True)
    return OffloadPolicy()
