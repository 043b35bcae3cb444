"""How the calibration times a call on the ranks : every rank at once, each repetition at its slowest
rank, a difference between two runs in pairs. Used by ``strategies/calibrate.py`` (compute),
``strategies/calibrate_optimizer.py`` (the optimizer's step) and ``strategies/calibrate_links.py``
(communication)."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from lightning_3d.parallel.group_cache import once_per_world

@dataclass(frozen=True)
class RunPrecision:
    """The run's precision as the calibration times it: Lightning's ``precision=`` flag read as data, so the
    timings run the kernels the run runs (bf16 matmuls are several times faster than fp32 ones on GPUs).

    >>> RunPrecision.of("bf16-mixed").autocast_dtype
    torch.bfloat16
    """

    autocast_dtype: Optional[torch.dtype] = None
    """Forwards run under ``torch.autocast`` to this dtype, as Lightning's ``MixedPrecision`` runs a step's
    (``"bf16-mixed"``, ``"16-mixed"``); the weights stay ``param_dtype``. None: no autocast."""
    param_dtype: torch.dtype = torch.float32
    """The dtype of weights, inputs and optimizer state: bf16 under ``"bf16-true"`` (Lightning's
    ``HalfPrecision`` converts the model), else fp32."""

    @classmethod
    def of(cls, precision: str) -> "RunPrecision":
        """The timing precision of Lightning's precision flag (``str(trainer.precision)``)."""
        autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        params = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)
        return cls(autocast_dtype=autocast, param_dtype=params)

    def forward(self, device: torch.device) -> ContextManager:
        """The context a timed forward runs in: autocast on ``device``'s type where the run autocasts. The
        backward runs outside it, as Lightning runs it (autograd keeps the forward's dtypes)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


FP32 = RunPrecision()
"""fp32 throughout ("32-true")."""

REPEATS = 5
"""Timed repetitions of each measurement after one warm-up; the median is kept."""
PAIRS = 7
"""Timed pairs of repetitions of a difference between two runs (:func:`median_extra_seconds`)."""
MIN_REPEAT_SECONDS = 0.02
"""The shortest timed repetition: a call is repeated within one until it lasts this long. A single short call
measures the clock and the scheduler's time slices (milliseconds where ranks share cores) more than the work."""
SHARED_CORES_REPEAT_SECONDS = 0.1
"""The shortest timed repetition where the ranks outnumber the host's cores. There one call of a block takes
tens of milliseconds of wall time, so a 0.02 s repetition is a single call, and how much the ranks' calls
overlap -- they leave the barrier several milliseconds apart -- changes from one repetition to the next, and a
small micro-batch can then time cheaper per token than a large one, which it is not. Several calls per
repetition keep all the ranks busy together, as in a step."""


def repeat_seconds(cores_per_rank: float | None) -> float:
    """The shortest timed repetition for ranks with ``cores_per_rank`` cores each (:func:`host_cores_per_rank`;
    None on GPUs)."""
    return SHARED_CORES_REPEAT_SECONDS if cores_per_rank is not None and cores_per_rank < 1 else MIN_REPEAT_SECONDS


def median_seconds(run: Callable[[], Any], device: torch.device, barrier: bool = False,
                   min_seconds: float = MIN_REPEAT_SECONDS) -> float:
    """Seconds of one ``run()``: the median over ``REPEATS`` timed repetitions after a warm-up, each repeating
    the call until it lasts ``min_seconds``. Collective where the process group is up: every rank
    repeats the call as often as the slowest needs (collectives match); with ``barrier`` the ranks start each
    repetition together, so that they run at once, as they do in a step; and each repetition counts at its
    slowest rank's time, as a step waits for its slowest rank each time (the median of those maxima, not the
    largest of the ranks' medians, which is shorter where ranks share cores and take turns being slow)."""
    calls = _agreed_calls((run,), device, barrier, min_seconds)
    return statistics.median(_slowest_each([_timed(run, calls, device, barrier) for _ in range(REPEATS)], device))


def median_extra_seconds(base: Callable[[], Any], extra: Callable[[], Any], device: torch.device,
                         min_seconds: float = MIN_REPEAT_SECONDS) -> float:
    """Seconds one ``extra()`` takes more than one ``base()``, >= 0: the median over ``PAIRS`` pairs of timed
    repetitions, one of each back to back, each of the two first in turn (the ranks start each repetition
    together, and it counts at its slowest rank's time, as in :func:`median_seconds`). Two medians taken one
    after the other also measure how the host's load moved in between, which where ranks share cores can be
    as large as the difference sought. A pair's two repetitions run under the same load. Collective."""
    runs = (base, extra)
    calls = _agreed_calls(runs, device, True, min_seconds)
    times: tuple[list[float], list[float]] = ([], [])  # base's, extra's
    for pair in range(PAIRS):
        for which in (0, 1) if pair % 2 == 0 else (1, 0):
            times[which].append(_timed(runs[which], calls, device, True))
    slowest = _slowest_each(times[0] + times[1], device)
    return max(0.0, statistics.median(b - a for a, b in zip(slowest[:PAIRS], slowest[PAIRS:])))


def _agreed_calls(runs: tuple[Callable[[], Any], ...], device: torch.device, barrier: bool,
                  min_seconds: float) -> int:
    """Calls per timed repetition: after a warm-up call of each run (first-call allocations, kernel selection),
    as many as make the slowest run last ``min_seconds`` on the slowest rank (collective where the process group
    is up: every rank then makes as many, and collectives inside the runs match)."""
    calls = 1
    for run in runs:
        run()
        _synchronize(device)
        calls = max(calls, math.ceil(min_seconds / max(_timed(run, 1, device, barrier), 1e-9)))
    if not dist.is_initialized():
        return calls
    agreed = torch.tensor([calls], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


def _timed(run: Callable[[], Any], calls: int, device: torch.device, barrier: bool) -> float:
    """Seconds per call of ``calls`` calls of ``run`` in a row (the ranks start together with ``barrier``)."""
    if barrier and dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    _synchronize(device)
    return (time.perf_counter() - start) / calls


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_each(times: list[float], device: torch.device) -> list[float]:
    """Each of ``times`` (the same repetitions on every rank), the largest over the ranks (one all-reduce)."""
    if not dist.is_initialized():
        return times
    values = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def world_mesh(device: torch.device):
    """A one-dimensional mesh of the world, made once per world: the timings of DTensor's optimizer step and
    of FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    return once_per_world(("calibration world mesh", device.type, world),
                          lambda: init_device_mesh(device.type, (world,)))


def release_device_memory(device: torch.device) -> None:
    """Hand what the calibration allocated back to the device: on CUDA its tensors, freed when it returned,
    stay in PyTorch's caching allocator, which the run's own allocations reuse but which ``mem_get_info`` and
    other processes count as taken, and a model, a graph or an optimizer state kept alive by a reference cycle
    is collected first. Nothing to do on CPU (freed memory goes back to the host's allocator)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def release_groups(*groups: Any) -> None:
    """Destroy this rank's side of process groups made for one measurement, once every rank is past their last
    use (the measurement ended on a collective of the world). Left alive, each kept a gloo group's three threads
    and its sockets -- on GPUs an NCCL communicator and its buffers -- for the life of the process, for every
    ``layout="auto"`` fit. Never the default group (a mesh dimension that spans the world may be it)."""
    seen = set()
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or group == dist.group.WORLD:
            continue
        if id(group) not in seen:
            seen.add(id(group))
            dist.destroy_process_group(group)
