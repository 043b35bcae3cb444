"""How fast these devices' links are, measured in seconds at launch, for ``layout="auto"``.

All-reduce, all-gather and reduce-scatter on groups of consecutive ranks (as tp and dp groups lie) and
point-to-point sends between the two halves of the world (as pipeline neighbours lie), each at two message
sizes -- a small one and the run's own largest (:func:`message_sizes`) --, so that ``time = ring steps x latency + bytes / bandwidth`` gives both numbers; a two-stage
pipeline schedule between those halves, for what the schedule itself costs per micro-batch beyond compute
and sends; and DistributedDataParallel's gradient synchronization of the model's own parameter tensors.
Every rank takes part (collectives); the slowest rank's numbers are kept, and the process groups made for a
measurement are destroyed after it. The compute timings are in ``strategies/calibrate.py`` (the optimizer's
in ``strategies/calibrate_optimizer.py``); the timing helpers they share, in ``strategies/calibrate_timing.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_3d.planner.links import LinkSpeed, latency_steps, wire_bytes
from lightning_3d.strategies.calibrate_timing import (MIN_REPEAT_SECONDS, median_extra_seconds, median_seconds,
                                                      release_groups, world_mesh)

MESSAGE_BYTES = (2**16, 2**22)
"""The two message sizes each link is timed at where the run sends nothing larger (64 KiB and 4 MiB): latency
dominates the first, bandwidth the second."""
LARGEST_MESSAGE_BYTES = 2**28
"""The largest message a link is timed at (256 MiB), whatever the run sends: a rank allocates it (twice for an
all-gather) at launch, and fast links reach their peak well below it."""


def message_sizes(run_largest_bytes: float) -> tuple[int, int]:
    """The two message sizes the links are timed at for a run whose largest message is ``run_largest_bytes``:
    64 KiB, for the latency, and the run's largest, between 4 MiB and :data:`LARGEST_MESSAGE_BYTES`, for the
    bandwidth. A link timed far below the messages it carries under-reads its bandwidth: NVLink reaches its
    peak only at tens of MiB, and ZeRO's and DDP's messages (a block's parameters, a 25 MiB bucket) are so
    large."""
    return MESSAGE_BYTES[0], int(min(max(run_largest_bytes, MESSAGE_BYTES[1]), LARGEST_MESSAGE_BYTES))


def link_speeds(world_size: int, per_node: int, device: torch.device,
                sizes: tuple[int, int] = MESSAGE_BYTES) -> dict[str, LinkSpeed]:
    """All-reduce inside groups of consecutive ranks ("tp": within a node) and across nodes ("dp": ranks of
    equal local rank; within the node on one node), and point-to-point between the world's two halves ("pp");
    all-gather and reduce-scatter on the same groups ("tp.all_gather", "dp.reduce_scatter", ...: ZeRO's and
    sequence parallelism's, which a backend may run at other speeds than its all-reduce), each at the two
    message ``sizes`` in bytes (:func:`message_sizes`). On one node the tp and dp groups are the same ranks,
    timed once. Collective: every rank of the world calls it."""
    if world_size == 1:
        return {dim: LinkSpeed(latency_s=0.0, bandwidth_bytes_per_s=float("inf")) for dim in ("tp", "pp", "dp")}
    inside = min(per_node, world_size)
    tp_group, _ = dist.new_subgroups(group_size=inside)
    if world_size > per_node:
        across = [list(range(local, world_size, per_node)) for local in range(per_node)]
        dp_group, _ = dist.new_subgroups_by_enumeration(across)
    else:
        dp_group = tp_group
    inside_speeds = _group_speeds(tp_group, device, sizes)
    across_speeds = inside_speeds if dp_group is tp_group else _group_speeds(dp_group, device, sizes)
    speeds = {"pp": _slowest(_p2p_speed(world_size, device, sizes), device)}
    for dim, timed in (("tp", inside_speeds), ("dp", across_speeds)):
        speeds.update({dim if collective == "all_reduce" else f"{dim}.{collective}": speed
                       for collective, speed in timed.items()})
    release_groups(tp_group, dp_group)
    return speeds


def _group_speeds(group, device: torch.device, sizes: tuple[int, int]) -> dict[str, LinkSpeed]:
    """All-reduce, all-gather and reduce-scatter on ``group``, each the world's slowest."""
    return {collective: _slowest(_collective_speed(collective, group, device, sizes), device)
            for collective in ("all_reduce", "all_gather", "reduce_scatter")}


PIPELINE_PROBE_MICROBATCHES = (2, 6)
"""The two micro-batch counts :func:`pipeline_microbatch_seconds` runs its schedule at: their difference is the
cost of 4 micro-batches, the schedule's fixed costs (its start, the last backward's wait) cancelled."""


def pipeline_microbatch_seconds(world_size: int, hidden_size: int, micro_tokens: int, device: torch.device,
                                pp: LinkSpeed, repeat_s: float = MIN_REPEAT_SECONDS) -> float:
    """What a pipeline stage spends per micro-batch beyond its compute and its sends: a two-stage 1F1B schedule
    of ``torch.distributed.pipelining`` over the world's two halves (rank r with r + world/2, as
    :func:`link_speeds` times p2p), every pair at once, each stage a ``hidden_size`` linear layer, timed at
    :data:`PIPELINE_PROBE_MICROBATCHES` micro-batches of ``micro_tokens`` tokens; the difference per
    micro-batch, less the layer's forward and backward (timed alone, every rank at once) and the two sends
    (activation, gradient) the step-time model charges with ``pp``. What is left is the schedule's own work
    and the waits of its hand-offs, which on ranks sharing cores (a wake-up per receive) the link speeds do not
    hold. Collective: every rank calls it. 0 on one rank."""
    if world_size < 2:
        return 0.0
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, half = dist.get_rank(), world_size // 2
    group, _ = dist.new_subgroups_by_enumeration([[r, r + half] for r in range(half)])  # an odd world's last: none
    layer = nn.Linear(hidden_size, hidden_size, device=device)
    x = torch.randn(1, micro_tokens, hidden_size, device=device, requires_grad=True)

    def layer_alone() -> None:
        layer(x).sum().backward()

    layer_s = median_seconds(layer_alone, device, barrier=True, min_seconds=repeat_s)
    steps = []
    for count in PIPELINE_PROBE_MICROBATCHES:
        run: Callable[[], Any] = lambda: None  # noqa: E731  (a rank in no pair still joins the timing's collectives)
        if rank < 2 * half:
            first = rank < half
            stage = PipelineStage(layer, 0 if first else 1, 2, device, group=group)
            schedule = Schedule1F1B(stage, count, loss_fn=lambda output, target: output.float().pow(2).mean())
            batch = torch.randn(count, micro_tokens, hidden_size, device=device)
            run = partial(schedule.step, batch) if first else partial(schedule.step, target=batch, losses=[])
        steps.append(median_seconds(run, device, barrier=True, min_seconds=repeat_s))
    release_groups(group)
    low, high = PIPELINE_PROBE_MICROBATCHES
    per_microbatch = max(0.0, steps[1] - steps[0]) / (high - low)
    sends = 2 * pp.seconds(micro_tokens * hidden_size * x.element_size())
    return max(0.0, per_microbatch - layer_s - sends)


DDP_PROBE_BYTES = 32 * 2**20
"""The most parameter bytes :func:`ddp_sync_seconds_per_byte` gives its stand-in (the model's first tensors up
to this size): a model this size or smaller is timed whole."""


def ddp_sync_seconds_per_byte(shapes: list[torch.Size], device: torch.device) -> float:
    """What ``DistributedDataParallel``'s gradient synchronization costs per gradient byte, over the world:
    a stand-in module holding parameters of the model's own ``shapes`` (float32, up to :data:`DDP_PROBE_BYTES`:
    :func:`probe_shapes`), whose forward touches each of them at almost no compute, wrapped by DDP as a run
    without tp, pp or ZeRO wraps the model; its forward + backward with the synchronization on against the same
    under ``no_sync``, in pairs. The difference is what DDP adds per step: its hook per parameter (copying the
    gradient into its bucket), the all-reduce per bucket as the reducer issues it, the copy back -- more than
    the all-reduce timed alone, which is why the stand-in is timed rather than the link. 0 for a model without parameters. Collective: every rank calls it."""
    timed = probe_shapes(shapes)
    total = 4 * sum(shape.numel() for shape in timed)
    if total == 0:
        return 0.0
    stand_in = _EveryParameterTouched(timed, device)
    ddp = nn.parallel.DistributedDataParallel(stand_in, device_ids=[device.index] if device.type == "cuda" else None)
    x = torch.ones(1, device=device)

    def synced() -> None:
        ddp(x).backward()

    def unsynced() -> None:
        with ddp.no_sync():
            ddp(x).backward()

    # One call per repetition: the synchronized call's all-reduce lines the ranks up, and it outlasts the
    # unsynchronized one many times (repeating both until that one lasts ``repeat_s`` took 10-30 s).
    extra = median_extra_seconds(unsynced, synced, device, min_seconds=0.0)
    return extra / total


def zero_sync_seconds_per_byte(unit_shapes: list[list[torch.Size]], device: torch.device, *,
                               reshard_after_forward: bool) -> float:
    """What FSDP2's ZeRO costs per gradient byte in a step over the world, as it runs it: the all-gathers before
    forward (and, with ``reshard_after_forward`` -- ZeRO-3 -- again before backward), the reduce-scatters from
    backward, its hooks and copies, and each collective's wait for the slowest rank. A stand-in holds the model's
    FSDP units as the strategy wraps them (``unit_shapes``: each block's parameter shapes, then the rest of the
    model's, the root's own; float32, up to :data:`DDP_PROBE_BYTES` in all, :func:`probe_shapes`), each
    ``fully_shard`` over the world, its forward touching each parameter at almost no compute; its forward +
    backward against the same stand-in unwrapped, in pairs: the link's reduce-scatter and all-gather alone
    predict about half of what FSDP2's step pays. 0 for a model without
    parameters. Collective: every rank calls it."""
    from torch.distributed.fsdp import fully_shard

    room, units = DDP_PROBE_BYTES, []
    for shapes in unit_shapes:
        if room <= 0:
            break
        units.append(probe_shapes(shapes, room))
        room -= 4 * sum(shape.numel() for shape in units[-1])
    total = 4 * sum(shape.numel() for shapes in units for shape in shapes)
    if total == 0:
        return 0.0
    plain, sharded = (_Units(units, device) for _ in range(2))
    mesh = world_mesh(device)
    for unit in sharded.units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=reshard_after_forward)
    x = torch.ones(1, device=device)
    extra = median_extra_seconds(lambda: plain(x).backward(), lambda: sharded(x).backward(), device,
                                 min_seconds=0.0)
    return extra / total


def probe_shapes(shapes: list[torch.Size], limit_bytes: int = DDP_PROBE_BYTES) -> list[torch.Size]:
    """The parameter shapes :func:`ddp_sync_seconds_per_byte` gives its stand-in: the model's, in order, up to
    ``limit_bytes`` of float32 in all; the tensor that crosses the limit is cut to a flat one that fills it (a
    large model's first tensor, its embedding, can alone be gigabytes)."""
    timed, room = [], limit_bytes // 4
    for shape in map(torch.Size, shapes):
        if room <= 0:
            break
        timed.append(shape if shape.numel() <= room else torch.Size([room]))
        room -= timed[-1].numel()
    return timed


class _EveryParameterTouched(nn.Module):
    """Parameters of the given shapes and a forward that reads one number of each: every one gets a gradient
    of its full size, and the forward and backward cost almost nothing beside that."""

    def __init__(self, shapes: list[torch.Size], device: torch.device) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(shape, device=device)) for shape in shapes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(weight.reshape(-1)[:1].sum() for weight in self.weights) * x


class _Units(nn.Module):
    """FSDP units of the given parameter shapes, the last list the root's own (:func:`zero_sync_seconds_per_byte`),
    each touched as :class:`_EveryParameterTouched` touches its parameters."""

    def __init__(self, unit_shapes: list[list[torch.Size]], device: torch.device) -> None:
        super().__init__()
        self.units = nn.ModuleList([_EveryParameterTouched(shapes, device) for shapes in unit_shapes[:-1]])
        self.own = _EveryParameterTouched(unit_shapes[-1], device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((unit(x) for unit in self.units), self.own(x))


def _collective_speed(collective: str, group, device: torch.device,
                      sizes: tuple[int, int] = MESSAGE_BYTES) -> LinkSpeed:
    """``collective`` on ``group`` at the two message ``sizes`` in bytes, a message being the whole tensor (what
    an all-gather returns, what a reduce-scatter takes), cut into equal shards of float32."""
    k = dist.get_world_size(group)
    times, timed = [], []
    for nbytes in sizes:
        whole = torch.zeros(nbytes // 4 // k * k, device=device)
        shard = torch.zeros(whole.numel() // k, device=device)
        call = {"all_reduce": partial(dist.all_reduce, whole, group=group),
                "all_gather": partial(dist.all_gather_single, whole, shard, group=group),
                "reduce_scatter": partial(dist.reduce_scatter_single, shard, whole, group=group)}[collective]
        times.append(median_seconds(call, device, barrier=True))
        timed.append(whole.numel() * 4)
    return LinkSpeed.fit(wire=tuple(wire_bytes(collective, n, k) for n in timed), seconds=tuple(times),
                         steps=latency_steps(collective, k))


def _p2p_speed(world_size: int, device: torch.device, sizes: tuple[int, int] = MESSAGE_BYTES) -> LinkSpeed:
    rank, half = dist.get_rank(), world_size // 2
    peer = (rank + half) % world_size if rank < 2 * half else None
    times = []
    for nbytes in sizes:
        buffer = torch.zeros(nbytes // 4, device=device)

        def exchange() -> None:  # the lower half sends first, the upper receives first: no deadlock
            if peer is None:
                return
            first, second = (dist.send, dist.recv) if rank < half else (dist.recv, dist.send)
            first(buffer, peer)
            second(buffer, peer)

        times.append(median_seconds(exchange, device, barrier=True) / 2)  # one way
    return LinkSpeed.fit(wire=tuple(4 * (n // 4) for n in sizes), seconds=tuple(times))


def _slowest(speed: LinkSpeed, device: torch.device) -> LinkSpeed:
    """The world's slowest: the largest latency and the smallest bandwidth over the ranks (one all-reduce)."""
    values = torch.tensor([speed.latency_s, -speed.bandwidth_bytes_per_s], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    latency, negative_bandwidth = values.tolist()
    return LinkSpeed(latency_s=latency, bandwidth_bytes_per_s=-negative_bandwidth)
