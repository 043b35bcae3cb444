"""Enumerate the layouts of a model on a cluster, keep those that fit, rank them by estimated step time."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Mapping

from lightning_3d.common import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, divisors, is_positive_int
from lightning_3d.errors import NoLayoutFits
from lightning_3d.parallel.config import ParallelConfigError
from lightning_3d.planner.calibration import Calibration
from lightning_3d.planner.cluster import Cluster, gib
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, Precision, peak_memory
from lightning_3d.planner.model import ModelSpec, PlannerError
from lightning_3d.planner.report import Candidate, LayoutPlan
from lightning_3d.planner.time import estimate_step_time

MAX_MICRO_BATCH_SIZE = 16
"""Largest micro-batch (sequences) the search tries; beyond it a step gains little and memory grows."""

CP_MIN_TOKENS = 4096
"""Context parallelism is tried only where each rank keeps at least this many tokens of a sequence: on
shorter parts the keys' and values' all-gather per block costs more than the activations it saves are worth
(Llama 3 split 128k-token sequences over 16 ranks: 8k each)."""


def evaluate(model: ModelSpec, layout: Layout, cluster: Cluster, precision: Precision, *,
             calibration: Calibration | None = None, accumulate: int = 1) -> Candidate:
    """Memory and time estimates of one layout (times from ``calibration`` when given, else the cluster's
    datasheet figures). ``accumulate``: batches per optimizer step (Lightning's ``accumulate_grad_batches``):
    the step time and tokens are that many batches' (``StepTime.accumulated``)."""
    _, memory = peak_memory(model, layout, precision)
    time = estimate_step_time(model, layout, cluster, precision, calibration=calibration)
    time = time.accumulated(accumulate, data_parallel_once=not layout.zero_stage)  # ZeRO re-gathers per batch
    tokens = accumulate * layout.global_batch_size * model.seq_length
    mfu = (None if cluster.peak_tflops is None else
           time.model_flops / time.total / (layout.world_size * cluster.peak_tflops * 1e12))
    return Candidate(layout, memory, time, tokens / time.total, mfu)


def plan(model: ModelSpec, cluster: Cluster, *, global_batch_size: int, precision: str | Precision = "bf16-mixed",
         schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b"), zero_stages: tuple[int, ...] = (0, 2, 3),
         recompute: tuple[str | None, ...] = (None, "selective", "full"), fixed: Mapping[str, Any] | None = None,
         calibration: Calibration | None = None) -> LayoutPlan:
    """Every layout of ``model`` on all of ``cluster``'s ranks that fits, fastest first.

    ``fixed``: :class:`Layout` fields held at a value (``{"tp": 2, "recompute": None}``); the others are
    searched. ``calibration``: measured speeds for the step times (needed on a cluster without a peak).
    Raises :class:`NoLayoutFits` (with the smallest memory any layout needs, also as ``smallest_bytes``, and
    what to change) when none fits, and :class:`PlannerError` for sizes no layout can split.

    Example::

        plan(model, Cluster.preset("h100"), global_batch_size=256, fixed={"pp": 1})
    """
    precision = _precision(precision)
    if not is_positive_int(global_batch_size):
        raise PlannerError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    fixed = _checked_fixed(fixed)
    options = dict(schedules=schedules, zero_stages=zero_stages, recompute=recompute, fixed=fixed)
    results, fitting = _search(model, cluster, global_batch_size, precision, options, calibration)
    if not results:
        raise PlannerError(
            f"No layout of {cluster.world_size} {cluster.rank_name}s splits this model and batch"
            f"{_held(fixed)}: {model.tp_rule}, and dp must divide global_batch_size ({global_batch_size})."
            " Pad vocab_size to a multiple of 128, use a global batch size with more divisors, or hold fewer"
            " settings fixed.")
    if not fitting:
        smallest = min(results, key=lambda c: c.memory.total)
        raise NoLayoutFits(_no_fit_message(model, cluster, precision, global_batch_size, results, options, calibration),
                           smallest_bytes=smallest.memory.total)
    faster = [c for c in results if c.time.total < fitting[0].time.total]
    return LayoutPlan(model, cluster, precision, global_batch_size, fitting, len(results), calibration=calibration,
                      fastest_unfit=min(faster, key=lambda c: c.time.total, default=None))


def _search(model, cluster, global_batch_size, precision, options,
            calibration) -> tuple[list[Candidate], list[Candidate]]:
    """Every layout's estimates, and those that fit, fastest first."""
    results = [evaluate(model, layout, cluster, precision, calibration=calibration)
               for layout in enumerate_layouts(model, cluster.world_size, cluster.gpus_per_node, global_batch_size,
                                               **options)]
    fitting = sorted((c for c in results if c.memory.total <= cluster.usable_bytes),
                     key=lambda c: (c.time.total, c.memory.total))
    return results, fitting


def _hsdp_shards(dp: int, tp: int, gpus_per_node: int) -> tuple[int, ...]:
    """ZeRO over all of dp (0), and HSDP's usual layout where dp crosses nodes: shard within a node (the
    shard group's tp * shard ranks fill one), replicate across nodes."""
    shard = gpus_per_node // tp
    return (0, shard) if 1 < shard < dp and dp % shard == 0 else (0,)


def enumerate_layouts(model: ModelSpec, world_size: int, gpus_per_node: int, global_batch_size: int, *,
                      schedules=("1f1b", "interleaved_1f1b"), zero_stages=(0, 2, 3),
                      recompute=(None, "selective", "full"), fixed: Mapping[str, Any] | None = None):
    """The layouts the strategy would accept: tp within a node and dividing heads, kv heads and the
    vocabulary; cp (context parallel) where each rank keeps at least ``CP_MIN_TOKENS`` of a sequence cut
    into 2 cp chunks; pp at most the layer count; dp dividing the batch; SP whenever tp > 1 (same
    communication, less memory); schedules, ZeRO stages and recompute modes as given, under ZeRO also HSDP
    where dp crosses nodes (:func:`_hsdp_shards`, not with cp); for a mixture of experts, ep dividing dp and
    the experts (:func:`_expert_parallel_sizes`); ``fixed`` fields at their value."""
    fixed = fixed or {}

    def options(name: str, choices) -> list:
        return [fixed[name]] if name in fixed else list(choices)

    for tp in options("tp", divisors(world_size)):
        if world_size % tp or tp > gpus_per_node or not model.splits_over(tp):
            continue
        for cp, pp in [(cp, pp) for cp in options("cp", _context_parallel_sizes(model, world_size // tp))
                       for pp in options("pp", divisors(world_size // tp))]:
            dp = world_size // (tp * cp * pp)
            if (world_size % (tp * cp * pp) or pp > model.num_layers or global_batch_size % dp
                    or fixed.get("dp", dp) != dp):
                continue
            per_replica = global_batch_size // dp
            for b in options("micro_batch_size", [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH_SIZE]):
                if per_replica % b or fixed.get("num_microbatches", per_replica // b) != per_replica // b:
                    continue
                for schedule, virtual in _schedules(pp, model.num_layers, schedules, fixed):
                    for zero in options("zero_stage", zero_stages if dp * cp > 1 else (0,)):
                        hsdp = _hsdp_shards(dp, tp, gpus_per_node) if zero and cp == 1 else (0,)
                        for shard, ep in [(shard, ep) for shard in options("dp_shard", hsdp)
                                          for ep in options("ep", _expert_parallel_sizes(model, dp, cp, shard))]:
                            if not model.splits_experts_over(ep):
                                continue
                            for mode in options("recompute", recompute):
                                if mode and model.dropout > 0 and tp > 1:
                                    continue  # refused by lightning-3d: the recompute would redraw dropout masks
                                sp = fixed.get("sequence_parallel", tp > 1 and model.seq_length // cp % tp == 0)
                                try:
                                    yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch_size=b,
                                                 num_microbatches=per_replica // b, schedule=schedule,
                                                 virtual_stages=virtual, zero_stage=zero, recompute=mode,
                                                 sequence_parallel=sp, dp_shard=shard, pipeline_reduce_grads=fixed.get(
                                                     "pipeline_reduce_grads", "per_step"))
                                except ParallelConfigError:
                                    continue  # e.g. fewer micro-batches than stages under 1F1B


def _expert_parallel_sizes(model: ModelSpec, dp: int, cp: int, shard: int) -> list[int]:
    """1, and for a mixture of experts the ep sizes that divide dp and the experts (not with cp or HSDP, which
    lightning-3d does not combine with ep yet)."""
    if not model.num_experts or cp > 1 or shard:
        return [1]
    return [ep for ep in divisors(dp) if model.num_experts % ep == 0]


def _context_parallel_sizes(model: ModelSpec, ranks: int) -> list[int]:
    """1, and the cp sizes of ``ranks`` that cut the sequence into 2 cp equal chunks leaving each rank at least
    ``CP_MIN_TOKENS`` tokens."""
    s = model.seq_length
    if model.dropout > 0:  # refused by lightning-3d: attention dropout under context parallelism
        return [1]
    return [1] + [cp for cp in divisors(ranks) if cp > 1 and s % (2 * cp) == 0 and s // cp >= CP_MIN_TOKENS]


def _schedules(pp: int, layers: int, allowed, fixed) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs: with pp = 1 none matters; interleaved schedules take 2, 4, 8, ...
    chunks per rank while every stage keeps a block (unless ``fixed`` says how many). More chunks shrink the
    bubble ((p - 1) / (v m)) and the first rank's activations (L (1 + (p - 1) / (p v)) layers' worth) for v
    times the point-to-point traffic: the time and memory models weigh it (Llama 3 405B ran 8)."""
    if pp == 1:
        return [("1f1b", 1)]
    if "schedule" in fixed:
        allowed = (fixed["schedule"],)
    found = [(s, 1) for s in allowed if s in PIPELINE_SCHEDULES and s not in MULTI_STAGE_SCHEDULES]
    chunks = [fixed["virtual_stages"]] if "virtual_stages" in fixed else [
        2 ** k for k in range(1, layers.bit_length()) if 2 ** k * pp <= layers]
    found += [(s, v) for s in allowed if s in MULTI_STAGE_SCHEDULES for v in chunks if layers >= v * pp]
    return [(s, v) for s, v in found if fixed.get("virtual_stages", v) == v]


def _checked_fixed(fixed: Mapping[str, Any] | None) -> dict:
    names = {f.name for f in fields(Layout)}
    unknown = sorted(set(fixed or {}) - names)
    if unknown:
        raise PlannerError(f"fixed names {unknown}, which are not Layout fields; they are {sorted(names)}.")
    return dict(fixed or {})


def _held(fixed: Mapping[str, Any]) -> str:
    """`` with tp=2, recompute=None`` for the fields held fixed; nothing when none is."""
    return " with " + ", ".join(f"{k}={v!r}" for k, v in fixed.items()) if fixed else ""


def _no_fit_message(model, cluster, precision, global_batch_size, results, options, calibration) -> str:
    smallest = min(results, key=lambda c: c.memory.total)
    mem = smallest.memory
    parts = ", ".join(f"{name} {gib(value)}" for name, value in
                      [("parameters", mem.parameters), ("gradients", mem.gradients),
                       ("optimizer state", mem.optimizer_state), ("activations", mem.activations),
                       ("gathered", mem.gathered)])
    advice = []
    for nodes in (2, 4, 8, 16, 32, 64, 128):
        bigger = replace(cluster, nodes=cluster.nodes * nodes)
        # The batch grows with the GPUs, so each data-parallel replica keeps its share.
        _, fitting = _search(model, bigger, global_batch_size * nodes, precision, options, calibration)
        if fitting:
            advice.append(f"{bigger.nodes} nodes ({bigger.world_size} {cluster.rank_name}s, global batch"
                          f" {global_batch_size * nodes})"
                          f" fit, e.g. {fitting[0].layout.describe()}")
            break
    if mem.activations > mem.parameters + mem.gradients + mem.optimizer_state:
        advice.append("activations dominate: a shorter seq_length or smaller model width")
    else:
        advice.append(f"model states dominate: more {cluster.rank_name}s to shard over (ZeRO-3, more pp / tp)")
    if options["fixed"]:
        advice.append("fewer settings held fixed")
    advice.append(f"{cluster.rank_name}s with more memory (it needs {gib(mem.total / cluster.usable_fraction)}"
                  " GiB each)")
    return (f"No layout of {model.name} ({model.num_parameters() / 1e9:.3g}B parameters, seq {model.seq_length})"
            f"{_held(options['fixed'])} fits {cluster.world_size} {cluster.rank_name}s of {cluster.memory_gib:.3g}"
            f" GiB ({gib(cluster.usable_bytes)} GiB usable each) at precision {precision.name}. The smallest"
            f" need is {gib(mem.total)} GiB per {cluster.rank_name}, with {smallest.layout.describe()} ({parts}"
            " GiB). To fit: " + "; or ".join(advice) + ".")


def _precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise PlannerError(f"precision={precision!r} is not known; choose one of {sorted(PRECISIONS)}.")
    return PRECISIONS[precision]

