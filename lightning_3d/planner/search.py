"""Enumerate the layouts of a model on a cluster, keep those that fit, rank them by estimated step time."""

from __future__ import annotations

from dataclasses import replace

from lightning_3d.common import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, divisors, is_positive_int
from lightning_3d.errors import NoLayoutFits
from lightning_3d.parallel.config import ParallelConfigError
from lightning_3d.planner.cluster import GIB, Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, Precision, peak_memory
from lightning_3d.planner.model import ModelSpec, PlannerError
from lightning_3d.planner.report import Candidate, LayoutPlan
from lightning_3d.planner.time import estimate_step_time

MAX_MICRO_BATCH_SIZE = 16
"""Largest micro-batch (sequences) the search tries; beyond it a step gains little and memory grows."""


def evaluate(model: ModelSpec, layout: Layout, cluster: Cluster, precision: Precision) -> Candidate:
    """Memory and time estimates of one layout."""
    _, memory = peak_memory(model, layout, precision)
    time = estimate_step_time(model, layout, cluster, precision)
    tokens = layout.global_batch_size * model.seq_length
    mfu = time.model_flops / time.total / (layout.world_size * cluster.peak_tflops * 1e12)
    return Candidate(layout, memory, time, tokens / time.total, mfu)


def plan(model: ModelSpec, cluster: Cluster, *, global_batch_size: int, precision: str | Precision = "bf16-mixed",
         schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b"), zero_stages: tuple[int, ...] = (0, 2, 3),
         recompute: tuple[str | None, ...] = (None, "selective", "full")) -> LayoutPlan:
    """Every layout of ``model`` on all of ``cluster``'s GPUs that fits, fastest first.

    Raises :class:`NoLayoutFits` (with the smallest memory any layout needs and what to change) when none
    fits, and :class:`PlannerError` for sizes no layout can split.
    """
    precision = _precision(precision)
    if not is_positive_int(global_batch_size):
        raise PlannerError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    options = dict(schedules=schedules, zero_stages=zero_stages, recompute=recompute)
    results, fitting = _search(model, cluster, global_batch_size, precision, options)
    if not results:
        raise PlannerError(
            f"No layout of {cluster.world_size} GPUs splits this model and batch: tp must divide num_heads"
            f" ({model.num_heads}), num_kv_heads ({model.kv_heads}) and vocab_size ({model.vocab_size}), and"
            f" dp must divide global_batch_size ({global_batch_size}). Pad vocab_size to a multiple of 128, or"
            " use a global batch size with more divisors.")
    if not fitting:
        raise NoLayoutFits(_no_fit_message(model, cluster, precision, global_batch_size, results, options))
    return LayoutPlan(model, cluster, precision, global_batch_size, fitting, len(results))


def _search(model, cluster, global_batch_size, precision, options) -> tuple[list[Candidate], list[Candidate]]:
    """Every layout's estimates, and those that fit, fastest first."""
    results = [evaluate(model, layout, cluster, precision)
               for layout in enumerate_layouts(model, cluster.world_size, cluster.gpus_per_node, global_batch_size,
                                               **options)]
    fitting = sorted((c for c in results if c.memory.total <= cluster.usable_bytes),
                     key=lambda c: (c.time.total, c.memory.total))
    return results, fitting


def enumerate_layouts(model: ModelSpec, world_size: int, gpus_per_node: int, global_batch_size: int, *,
                      schedules=("1f1b", "interleaved_1f1b"), zero_stages=(0, 2, 3),
                      recompute=(None, "selective", "full")):
    """The layouts the strategy would accept: tp within a node and dividing heads, kv heads and the
    vocabulary; pp at most the layer count; dp dividing the batch; SP whenever tp > 1 (same communication,
    less memory); schedules, ZeRO stages and recompute modes as given."""
    for tp in divisors(world_size):
        if tp > gpus_per_node or model.num_heads % tp or model.kv_heads % tp or model.vocab_size % tp:
            continue
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if pp > model.num_layers or global_batch_size % dp:
                continue
            per_replica = global_batch_size // dp
            for b in [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH_SIZE]:
                for schedule, virtual in _schedules(pp, model.num_layers, schedules):
                    for zero in (zero_stages if dp > 1 else (0,)):
                        for mode in recompute:
                            if mode and model.dropout > 0 and tp > 1:
                                continue  # refused by lightning-3d: the recompute would redraw dropout masks
                            try:
                                yield Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=b,
                                             num_microbatches=per_replica // b, schedule=schedule,
                                             virtual_stages=virtual, zero_stage=zero, recompute=mode,
                                             sequence_parallel=tp > 1 and model.seq_length % tp == 0)
                            except ParallelConfigError:
                                continue  # e.g. fewer micro-batches than stages under 1F1B


def _schedules(pp: int, layers: int, allowed) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    found = [(s, 1) for s in allowed if s in PIPELINE_SCHEDULES and s not in MULTI_STAGE_SCHEDULES]
    found += [(s, 2) for s in allowed if s in MULTI_STAGE_SCHEDULES and layers >= 2 * pp]
    return found


def _no_fit_message(model, cluster, precision, global_batch_size, results, options) -> str:
    smallest = min(results, key=lambda c: c.memory.total)
    mem = smallest.memory
    parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in
                      [("parameters", mem.parameters), ("gradients", mem.gradients),
                       ("optimizer state", mem.optimizer_state), ("activations", mem.activations),
                       ("gathered", mem.gathered)])
    advice = []
    for nodes in (2, 4, 8, 16, 32, 64, 128):
        bigger = replace(cluster, nodes=cluster.nodes * nodes)
        # The batch grows with the GPUs, so each data-parallel replica keeps its share.
        _, fitting = _search(model, bigger, global_batch_size * nodes, precision, options)
        if fitting:
            advice.append(f"{bigger.nodes} nodes ({bigger.world_size} GPUs, global batch {global_batch_size * nodes})"
                          f" fit, e.g. {fitting[0].layout.describe()}")
            break
    if mem.activations > mem.parameters + mem.gradients + mem.optimizer_state:
        advice.append("activations dominate: a shorter seq_length or smaller model width")
    else:
        advice.append("model states dominate: more GPUs to shard over (ZeRO-3, more pp / tp)")
    advice.append(f"GPUs with more memory (it needs {mem.total / cluster.usable_fraction / GIB:.1f} GiB each)")
    return (f"No layout of {model.name} ({model.num_parameters() / 1e9:.2f}B parameters, seq {model.seq_length})"
            f" fits {cluster.world_size} GPUs of {cluster.memory_gib:g} GiB ({cluster.usable_bytes / GIB:.1f} GiB"
            f" usable each) at precision {precision.name}. The smallest need is {mem.total / GIB:.1f} GiB per GPU,"
            f" with {smallest.layout.describe()} ({parts} GiB). To fit: " + "; or ".join(advice) + ".")


def _precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise PlannerError(f"precision={precision!r} is not known; choose one of {sorted(PRECISIONS)}.")
    return PRECISIONS[precision]

