"""``layout="auto"``: the strategy picks tp, pp, schedule, micro-batches, ZeRO and recompute at launch.

At set-up, after ``configure_model()`` built the model on the meta device and before any collective of the
model, every rank:

1. reads the first training batch (the per-replica batch size and the sequence length, as Lightning's loader
   gives them) and describes the model for the planner (``ModelSpec``): from its config for the reference GPT
   or a Hugging Face model, else -- any model whose blocks the policy finds -- measured on the model itself on
   fake tensors (``strategies/measure_model.py``: parameters per piece, FLOPs, bytes saved for backward);
2. takes its memory budget (``max_memory_per_device``, else free device memory on CUDA or the host's available
   memory divided among its ranks on CPU), the smallest over the ranks, before the calibration allocates
   anything;
3. calibrates (``strategies/measure.py``) in the run's precision: one of the model's blocks forward and
   backward at the candidate micro-batch sizes, the output head with its loss, an AdamW step on the block's
   parameters, the links (all-reduce, point-to-point) at two message sizes, a pipeline schedule's own cost per
   micro-batch, and DistributedDataParallel's gradient synchronization of the model's parameters, keeping the
   slowest rank's numbers; then hands what it allocated back to the device (``torch.cuda.empty_cache``).

Global rank 0 then asks the planner for every layout that fits (:func:`ranked`), the fixed settings kept as
given, and broadcasts the fastest -- by time per token, since the batch is per replica: a layout with more
data-parallel replicas trains more tokens per step. Every rank goes on with that one config. The strategy
logs the top three with their predicted step time and memory, and why the winner won; after
``layout_check_steps`` it logs the measured step time against the prediction (:class:`PredictionCheck`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_3d.common import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, divisors
from lightning_3d.errors import LayoutError, NoLayoutFits, ParallelConfigError, PolicyError
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.memory import host_memory_available
from lightning_3d.planner.cluster import GIB, Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, Precision
from lightning_3d.planner.model import ModelSpec, model_spec
from lightning_3d.planner.report import Candidate, why_best
from lightning_3d.planner.search import evaluate
from lightning_3d.strategies.calibrate_timing import RunPrecision, release_device_memory
from lightning_3d.strategies.measure import measure
from lightning_3d.strategies.measure_model import measured_model_spec

if TYPE_CHECKING:
    from lightning_3d.planner.calibration import Calibration

MISMATCH = 0.25
"""Measured and predicted step time may differ by this share before the strategy warns."""


@dataclass(frozen=True)
class Decision:
    """What global rank 0 chose, as every rank receives it."""

    values: dict
    """The auto fields' values (``ParallelConfig.decided(**values)``)."""
    layout: Layout
    """The chosen layout as the planner sees it."""
    predicted_step_s: float
    """Seconds of one optimizer step (of ``accumulate_grad_batches`` batches)."""
    predicted_memory_bytes: float
    """The planner's peak bytes per rank for the chosen layout."""
    memory_per_rank: float
    """The budget it had to fit (``max_memory_per_device`` or what the devices have free)."""
    report: str
    """Top three and why, for the log."""
    calibration: Optional[Calibration] = None
    """The speeds measured at launch (every rank measured them; the slowest rank's are kept), to predict other
    layouts with: ``evaluate(spec, layout, host_cluster(...), precision, calibration=decision.calibration)``."""


def ranked(spec: ModelSpec, config: ParallelConfig, *, world_size: int, per_node: int, batch_size: int,
           precision: Precision, memory_per_rank: float, calibration: Optional[Calibration],
           cluster: Optional[Cluster] = None, accumulate: int = 1) -> list[Candidate]:
    """Every layout the config leaves open that fits ``memory_per_rank`` bytes, fastest per token first, each
    timed as an optimizer step of ``accumulate`` batches (Lightning's ``accumulate_grad_batches``: the
    data-parallel synchronization and the optimizer's update are paid once per that many batches).

    Raises :class:`NoLayoutFits` with the smallest memory any of them needs when none fits, naming the fixed
    settings when they are why."""
    cluster = cluster or host_cluster(world_size, per_node, memory_per_rank)
    results = [evaluate(spec, layout, cluster, precision, calibration=calibration, accumulate=accumulate)
               for layout in candidate_layouts(spec, config, world_size, per_node, batch_size)]
    if not results:
        raise ParallelConfigError(
            f"layout='auto' found no layout of {world_size} ranks for this model and batch: {spec.tp_rule}, pp"
            f" at most the {spec.num_layers} blocks, micro-batches the per-replica batch ({batch_size}); fixed"
            f" settings: {_fixed(config) or 'none'}.")
    fitting = [c for c in results if c.memory.total <= memory_per_rank]
    if not fitting:
        smallest = min(results, key=lambda c: c.memory.total)
        raise NoLayoutFits(
            f"No layout of {world_size} ranks fits {_size(memory_per_rank)} per rank (fixed settings:"
            f" {_fixed(config) or 'none'}). The smallest need is {_size(smallest.memory.total)} per rank, with"
            f" {smallest.layout.describe()}. Give each rank more memory (max_memory_per_device), more ranks, a"
            " smaller batch or sequence, or leave more settings to 'auto'.")
    return sorted(fitting, key=lambda c: (seconds_per_token(c), c.memory.total))


def seconds_per_token(candidate: Candidate) -> float:
    return 1 / candidate.tokens_per_second


def candidate_layouts(spec: ModelSpec, config: ParallelConfig, world_size: int, per_node: int,
                      batch_size: int) -> Iterator[Layout]:
    """The layouts of ``world_size`` ranks that keep the config's fixed settings: each replica takes the
    loader's ``batch_size`` sequences per step, as ``num_microbatches`` micro-batches under a pipeline (one
    batch without: Lightning's own accumulation stays the user's)."""
    auto = set(config.auto_fields)
    cp = config.context_parallel_size  # fixed: the decision keeps the user's split of each sequence

    def options(name: str, choices) -> list:
        return list(choices) if name in auto else [getattr(config, name)]

    for tp in options("tensor_parallel_size", divisors(world_size)):
        if tp > per_node or world_size % (tp * cp) or not spec.splits_over(tp):
            continue
        for pp in options("pipeline_parallel_size", divisors(world_size // (tp * cp))):
            dp = world_size // (tp * cp * pp)
            if pp > spec.num_layers or world_size % (tp * cp * pp):
                continue
            if config.data_parallel_size != "auto" and dp != config.data_parallel_size:
                continue
            shard = config.data_parallel_shard_size
            if shard != "auto" and dp % shard:
                continue  # the run's HSDP shard groups must divide dp
            for schedule, virtual, m in _pipelines(pp, spec.num_layers, batch_size, config, auto):
                for zero in options("zero_stage", (0, 2, 3) if dp * cp > 1 else (0,)):
                    for recompute in options("activation_checkpointing", (None, "selective", "full")):
                        if recompute and spec.dropout > 0 and tp > 1:
                            continue  # refused by lightning-3d: recompute would redraw dropout masks
                        try:  # (expert_parallel_size stays the user's: its dp must be a multiple)
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=config.expert_parallel_size,
                                         micro_batch_size=batch_size // m, num_microbatches=m,
                                         schedule=schedule, virtual_stages=virtual, zero_stage=zero,
                                         recompute=recompute, sequence_parallel=config.sequence_parallel and tp > 1,
                                         dp_shard=_hsdp_shard(config, dp))
                        except ParallelConfigError:
                            continue


def _hsdp_shard(config: ParallelConfig, dp: int) -> int:
    """The user's HSDP shard size where it splits this dp into replicas (the run will use it), else 0 (ZeRO
    over all of dp)."""
    shard = config.data_parallel_shard_size
    return shard if shard != "auto" and shard < dp else 0


def _pipelines(pp: int, layers: int, batch_size: int, config: ParallelConfig, auto: set) -> Iterator[tuple]:
    """(schedule, chunks per rank, micro-batches) for ``pp`` stages."""
    if pp == 1:
        yield "1f1b", 1, 1
        return
    schedules = PIPELINE_SCHEDULES if "pipeline_schedule" in auto else (config.pipeline_schedule,)
    counts = [m for m in divisors(batch_size) if m >= pp] if "num_microbatches" in auto else \
        [config.num_microbatches or pp]
    for schedule in schedules:
        if "pipeline_schedule" not in auto:
            virtual = config.virtual_pipeline_size
        elif schedule in MULTI_STAGE_SCHEDULES:
            if layers < 2 * pp:
                continue  # two chunks per rank need two blocks per rank
            virtual = 2
        else:
            virtual = 1
        for m in counts:
            if batch_size % m == 0:
                yield schedule, virtual, m


def values_of(layout: Layout, config: ParallelConfig) -> dict:
    """The auto fields' values for ``layout`` (what :meth:`ParallelConfig.decided` takes)."""
    chosen = {"tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp,
              "pipeline_schedule": layout.schedule, "num_microbatches": layout.num_microbatches if layout.pp > 1 else None,
              "zero_stage": layout.zero_stage, "activation_checkpointing": layout.recompute}
    values = {name: chosen[name] for name in config.auto_fields}
    if "pipeline_schedule" in config.auto_fields:
        values["virtual_pipeline_size"] = layout.virtual_stages
    return values


def report(candidates: list[Candidate], spec: ModelSpec, calibrated: bool) -> str:
    """The top three, each with its predicted step time and memory, and why the first won."""
    lines = [f"lightning_3d: layout='auto' chose {candidates[0].layout.describe()} of {len(candidates)} layouts"
             f" that fit ({'calibrated on these devices' if calibrated else 'not calibrated: assumed speeds'}):"]
    for index, c in enumerate(candidates[:3], 1):
        lines.append(f"  {index}. {c.layout.describe():<40} step {c.time.total * 1e3:9.1f} ms predicted,"
                     f" {seconds_per_token(c) * 1e6:8.2f} us/token, {c.memory.total / 2**20:9.1f} MiB per rank")
    lines.append(f"  why: {why_best(candidates)}")
    return "\n".join(lines)


def host_cluster(world_size: int, per_node: int, memory_per_rank: float, device_type: str = "cpu") -> Cluster:
    """The planner's cluster for these ranks and their memory budget; the speeds come from the calibration."""
    per_node = min(per_node, world_size)
    nodes = max(1, world_size // per_node)
    if device_type == "cpu":
        return Cluster.cpu(ranks_per_node=per_node, nodes=nodes, memory_bytes_per_rank=memory_per_rank)
    return Cluster(gpus_per_node=per_node, nodes=nodes, memory_gib=memory_per_rank / GIB, usable_fraction=1.0)


ASSUMED_CPU_FLOPS = 20e9
"""FLOP/s one CPU rank is assumed to reach in a dry run (no calibration): a few cores' worth of fp32."""
ASSUMED_CPU_LINK = (50e-6, 1e9)
"""Latency (s) and bandwidth (bytes/s) assumed for every link between CPU ranks in a dry run (gloo on one host)."""


def assumed_calibration(spec: ModelSpec) -> "Calibration":
    """What a dry run plans CPU ranks with: a block's and the head's FLOPs at :data:`ASSUMED_CPU_FLOPS`, links
    at :data:`ASSUMED_CPU_LINK`. Assumed, not measured: a run calibrates before it chooses."""
    from lightning_3d.planner.calibration import Calibration
    from lightning_3d.planner.links import LinkSpeed
    from lightning_3d.planner.time import block_forward_flops, head_forward_flops

    link = LinkSpeed(latency_s=ASSUMED_CPU_LINK[0], bandwidth_bytes_per_s=ASSUMED_CPU_LINK[1])
    per_token = 3 * block_forward_flops(spec, spec.seq_length) / spec.seq_length / ASSUMED_CPU_FLOPS
    head = 3 * head_forward_flops(spec, 1) / ASSUMED_CPU_FLOPS
    return Calibration(block_seconds_per_token={1: per_token}, head_seconds_per_token=head, tp=link, pp=link, dp=link)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _fixed(config: ParallelConfig) -> str:
    from lightning_3d.parallel.config import AUTO_FIELDS

    fixed = [f"{name}={getattr(config, name)!r}" for name in AUTO_FIELDS if name not in config.auto_fields]
    if config.expert_parallel_size > 1:
        fixed.append(f"expert_parallel_size={config.expert_parallel_size}")
    return ", ".join(fixed)


# ---------------------------------------------------------------------------------------------- on the ranks


def decide_layout(config: ParallelConfig, module, policy, trainer, *, world_size: int, per_node: int,
                  device: torch.device) -> Decision:
    """What :func:`decide` needs, from the strategy's objects: the planner's description of the model (from its
    config, or measured: ``strategies/measure_model.py``), its blocks (the policy's plan), the first training
    batch and the precision. Collective."""
    from lightning_3d.parallel.parallelize import plan_model
    from lightning_3d.parallel.tensor_parallel import check_tp_plan

    batch = first_training_batch(trainer)
    probe = config.decided(tensor_parallel_size=1, pipeline_parallel_size=1, pipeline_schedule="1f1b",
                           num_microbatches=None, zero_stage=0, activation_checkpointing=None)
    plan = plan_model(policy, module, probe, 1)
    precision = str(trainer.precision)
    if precision not in PRECISIONS or not plan.blocks:
        why = (f"it models precision {sorted(PRECISIONS)}, not {precision!r}" if precision not in PRECISIONS
               else "the policy names no blocks")
        raise ParallelConfigError(f"layout='auto' needs the planner's model of this run, but {why}. Set the layout"
                                  f" ({', '.join(config.auto_fields)}) explicitly.")
    known = model_spec(module, _sequence_length(batch))
    tp_plans = {}  # the tp sizes a layout may take, each timed split as the policy splits it
    for tp in divisors(world_size):
        allowed = "tensor_parallel_size" in config.auto_fields or tp == config.tensor_parallel_size
        if 1 < tp <= per_node and allowed and (known is None or known.splits_over(tp)):
            try:  # (timed without sequence parallelism: the block's input is then whole, as captured)
                tp_plans[tp] = plan_model(policy, module, replace(probe, sequence_parallel=False), tp)
                if known is None:  # a measured model's sizes are not known to divide: the plan's own check
                    check_tp_plan(module, tp_plans[tp].tp_plan, tp)
            except (PolicyError, LayoutError):
                tp_plans.pop(tp, None)
                continue  # a size the policy cannot split this model by: no layout takes it
    spec = known or measured_model_spec(module, plan, tp_plans, batch, device=device, precision=precision)
    return decide(config, module=module, spec=spec, blocks=plan.blocks, tp_plans=tp_plans, batch=batch,
                  precision_name=precision, world_size=world_size, per_node=per_node, device=device,
                  accumulate=trainer.accumulate_grad_batches)


def first_training_batch(trainer) -> Any:
    """The first batch of the training data, read from a fresh loader (the run's own is made later)."""
    # Lightning keeps where the training data comes from (datamodule, module hook or the loaders given to
    # fit) in this private source; no public call returns the loader before the fit loop sets it up.
    loader = trainer.fit_loop._data_source.dataloader()
    return next(iter(loader))


def _sequence_length(batch: Any) -> Optional[int]:
    from torch.utils._pytree import tree_flatten

    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.ndim >= 2]
    return int(tensors[0].shape[1]) if tensors else None


def decide(config: ParallelConfig, *, module, spec: ModelSpec, blocks: list[str], tp_plans: dict, batch: Any,
           precision_name: str, world_size: int, per_node: int, device: torch.device,
           accumulate: int = 1) -> Decision:
    """The launch-time decision on every rank (collective: calibration, then rank 0's choice broadcast).
    ``blocks``: the policy's blocks (the first is timed); ``tp_plans``: the policy's plan at each tp size to time
    it split by; ``accumulate``: the trainer's ``accumulate_grad_batches`` (batches per optimizer step)."""
    precision = PRECISIONS[precision_name]
    batch_size = _batch_size(batch)
    # The budget first: read after the calibration, free device memory would miss what its tensors left in the
    # caching allocator.
    memory = memory_per_rank(config, device, per_node)
    try:
        calibration = measure(config, module=module, spec=spec, blocks=blocks, tp_plans=tp_plans, batch=batch,
                              batch_size=batch_size, world_size=world_size, per_node=per_node, device=device,
                              precision=RunPrecision.of(precision_name))
    finally:
        release_device_memory(device)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            cluster = host_cluster(world_size, per_node, memory, device.type)
            candidates = ranked(spec, config, world_size=world_size, per_node=per_node, batch_size=batch_size,
                                precision=precision, memory_per_rank=memory, calibration=calibration,
                                cluster=cluster, accumulate=accumulate)
            best = candidates[0]
            box[0] = {"values": values_of(best.layout, config), "layout": best.layout,
                      "predicted_step_s": best.time.total, "predicted_memory_bytes": best.memory.total,
                      "memory_per_rank": memory, "report": report(candidates, spec, calibrated=True)}
        except (NoLayoutFits, ParallelConfigError) as error:  # every rank raises it, after the broadcast
            box[0] = {"error": f"{type(error).__name__}: {error}"}
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu") if _host_ok() else device)
    if "error" in box[0]:
        kind, _, message = box[0]["error"].partition(": ")
        raise (NoLayoutFits if kind == "NoLayoutFits" else ParallelConfigError)(message)
    return Decision(**box[0], calibration=calibration)


def memory_per_rank(config: ParallelConfig, device: torch.device, per_node: int) -> float:
    """What one rank may fill: ``max_memory_per_device``, else free device memory (CUDA) or the host's
    available memory over its ranks (CPU); the smallest over the ranks. :func:`decide` reads it before the
    calibration allocates anything. Collective."""
    if config.max_memory_per_device is not None:
        return float(config.max_memory_per_device)
    if device.type == "cuda":
        mine = float(torch.cuda.mem_get_info(device)[0])
    else:
        mine = float((host_memory_available() or 0) // max(1, per_node))
    value = torch.tensor([mine], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def _batch_size(batch: Any) -> int:
    from torch.utils._pytree import tree_flatten

    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.ndim]
    if not tensors:
        raise ParallelConfigError("layout='auto' reads the batch size from the first training batch, but it holds"
                                  " no tensor.")
    return int(tensors[0].shape[0])


def _host_ok() -> bool:
    return "gloo" in (dist.get_backend() or "")


class PredictionCheck:
    """Measured against predicted time per optimizer step, once, after ``steps`` optimizer steps (the first two
    left out: they build schedules and allocate).

    Time the run spends between two steps on other work -- validation, saving a checkpoint -- is left out: the
    strategy calls :meth:`pause` and :meth:`resume` around it. With Lightning's ``accumulate_grad_batches`` an
    optimizer step is ``accumulate`` batches, as the prediction is (``ranked``)."""

    def __init__(self, predicted_step_s: float, steps: int, *, accumulate: int = 1) -> None:
        self.predicted_step_s, self.steps, self.accumulate = predicted_step_s, steps, accumulate
        self._start: Optional[float] = None
        self._paused_s = 0.0
        self._pauses = 0  # nested: a checkpoint saved at the end of validation
        self._pause_start = 0.0
        self.measured_step_s: Optional[float] = None

    def pause(self) -> None:
        """Other work than training steps begins (validation, a checkpoint's save): not counted until resumed."""
        self._pauses += 1
        if self._pauses == 1:
            self._pause_start = time.perf_counter()

    def resume(self) -> None:
        if self._pauses == 0:  # not paused: nothing to count
            return
        self._pauses -= 1
        if self._pauses == 0 and self._start is not None:
            self._paused_s += time.perf_counter() - self._pause_start

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def on_step(self, global_step: int) -> None:
        """Called at the start of each training batch with the optimizer steps done so far."""
        if self.measured_step_s is not None:
            return
        if global_step == 2 and self._start is None:
            self._start = time.perf_counter()
        elif self._start is not None and global_step == 2 + self.steps:
            self.measured_step_s = (time.perf_counter() - self._start - self._paused_s) / self.steps
            ratio = self.measured_step_s / self.predicted_step_s
            batches = f" of {self.accumulate} accumulated batches" if self.accumulate > 1 else ""
            line = (f"lightning_3d: layout='auto' measured {self.measured_step_s * 1e3:.1f} ms per step{batches}"
                    f" over {self.steps} steps, predicted {self.predicted_step_s * 1e3:.1f} ms (x{ratio:.2f})")
            if abs(ratio - 1) > MISMATCH:
                rank_zero_warn(line + f": more than {MISMATCH:.0%} apart. Not modelled: Lightning's loop and the"
                               " step's own work around the model (logging, sync_dist, metrics, the next batch),"
                               " which on steps of tens of milliseconds can make that difference. Otherwise the"
                               " planner's model of this run is off and the chosen layout may not be the fastest"
                               " (compare with `lightning-3d plan`).")
            else:
                rank_zero_info(line)
