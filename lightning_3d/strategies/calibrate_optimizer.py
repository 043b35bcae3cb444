"""How fast the optimizer steps on these devices, measured at launch for ``layout="auto"``: an AdamW
step on one block's parameters, materialized from the meta build as ``strategies/calibrate.py`` times the block
(seconds per parameter), and on one tensor of the embedding's shape (per parameter: the few large tensors
outside the blocks cost per number, not per tensor); and what the step costs more on the same parameters as
DTensors, replicated as tensor parallelism leaves them or sharded as FSDP2 does (per block).

AdamW stands for the user's optimizer, which is not built yet when the layout is chosen. Each timing is
collective: every rank times at once, and the slowest rank's number is kept (``strategies/calibrate_timing.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_3d.strategies.calibrate import materialized
from lightning_3d.strategies.calibrate_timing import (FP32, MIN_REPEAT_SECONDS, RunPrecision, median_extra_seconds,
                                                      median_seconds, world_mesh)


def optimizer_seconds_per_parameter(block: nn.Module, device: torch.device, repeat_s: float = MIN_REPEAT_SECONDS,
                                    *, precision: RunPrecision = FP32) -> float:
    """Seconds of one AdamW step per parameter, on the parameters of ``block`` (a meta copy is fine) as the
    model has them -- their count and sizes, which set the per-tensor cost of a step that loops over them --
    in the dtype the run's optimizer steps (``precision.param_dtype``: bf16 under "bf16-true", else the fp32
    master weights). AdamW stands for the user's optimizer, which is not built yet when the layout is chosen.
    Collective."""
    params = materialized(block, device, dtype=precision.param_dtype).parameters()
    return _adamw_seconds_per_parameter([p for p in params if p.requires_grad], device, repeat_s)


EMBEDDING_PROBE_NUMBERS = 2**21
"""The most numbers :func:`embedding_optimizer_seconds_per_parameter` times (8 MiB of float32): already so many
that a tensor's fixed cost is lost in its numbers' (a larger embedding is cut to a flat tensor of this size)."""


def embedding_optimizer_seconds_per_parameter(vocab_size: int, hidden_size: int, device: torch.device,
                                              repeat_s: float = MIN_REPEAT_SECONDS, *,
                                              precision: RunPrecision = FP32) -> float:
    """As :func:`optimizer_seconds_per_parameter`, on one tensor of the embedding's shape (``vocab_size x
    hidden_size``, up to :data:`EMBEDDING_PROBE_NUMBERS`), as the parameters outside the blocks are: a few large
    tensors, in ``precision.param_dtype``. Collective."""
    shape = (vocab_size, hidden_size) if vocab_size * hidden_size <= EMBEDDING_PROBE_NUMBERS \
        else (EMBEDDING_PROBE_NUMBERS,)
    weight = nn.Parameter(torch.zeros(shape, device=device, dtype=precision.param_dtype))
    return _adamw_seconds_per_parameter([weight], device, repeat_s)


def _adamw_seconds_per_parameter(params: list[Tensor], device: torch.device, repeat_s: float) -> float:
    if not params:
        return 0.0
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    return median_seconds(optimizer.step, device, barrier=True, min_seconds=repeat_s) / sum(p.numel() for p in params)


def dtensor_optimizer_seconds_per_block(block: nn.Module, device: torch.device,
                                        repeat_s: float = MIN_REPEAT_SECONDS, *, sharded: bool = False,
                                        precision: RunPrecision = FP32) -> float:
    """What one AdamW step over ``block``'s parameters costs more when they are DTensors (as tensor parallelism
    and FSDP2 make them) than as plain tensors of the same local size: replicated over a mesh of the world, or
    with ``sharded`` each split along its first dimension over it (FSDP2's local shards: 1 / world of the
    numbers), so that only DTensor's dispatch differs -- a sharding propagation and a local call per tensor of
    each of the optimizer's ops, which on a block of many small tensors costs several times its arithmetic,
    and grows with the numbers a rank holds. In ``precision.param_dtype``. Seconds, >= 0. Collective."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = world_mesh(device)
    whole = [param for param in materialized(block, device, dtype=precision.param_dtype).parameters()
             if param.requires_grad]
    if not whole:
        return 0.0
    world = mesh.size()
    plain = [nn.Parameter(torch.randn(_first_dim_shard(p.shape, world), device=device, dtype=p.dtype)) if sharded else p
             for p in whole]
    placement = Shard(0) if sharded else Replicate()
    spread = [nn.Parameter(DTensor.from_local(param.detach().clone(), mesh, [placement], run_check=False))
              for param in plain]
    for param in plain:
        param.grad = torch.randn_like(param)
    for param, twin in zip(plain, spread):
        twin.grad = DTensor.from_local(param.grad.clone(), mesh, [placement], run_check=False)
    base, extra = (torch.optim.AdamW(params, lr=1e-6).step for params in (plain, spread))
    return median_extra_seconds(base, extra, device, repeat_s)


def _first_dim_shard(shape: torch.Size, world: int) -> tuple[int, ...]:
    """One rank's shard of a tensor split along its first dimension over ``world`` ranks, as FSDP2 pads it (a
    scalar as one number)."""
    return (-(-shape[0] // world), *shape[1:]) if len(shape) else (1,)
