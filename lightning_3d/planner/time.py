"""The step-time model: compute, tensor-parallel communication, pipeline bubble, data-parallel communication.

FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 5.1): a block's forward on b sequences of s tokens is 24 b s h^2 + 4 b s^2 h
matmul FLOPs (for a 4h MLP; generally q/k/v/o, the MLP matrices and the two attention products), the head
2 b s h V; backward doubles each, full recompute adds a block forward. Over a step of B sequences this is
their 96 B s l h^2 (1 + s / 6h + V / 16 l h).

Time on one GPU, per micro-batch, for the blocks and head its pipeline rank holds:
  * compute: FLOPs / tp at ``gemm_efficiency`` x peak, plus the non-matmul work (norms, activation,
    softmax, residual adds), bound by memory bandwidth: ``ELEMENTWISE_PASSES`` x the block's saved
    activation bytes, read or written, at ``hbm_bandwidth``;
  * tensor parallel: per block 2 all-reduces (or reduce-scatter + all-gather pairs with SP, the same bytes)
    of b s h activations in forward, 2 in backward, 2 more for a recomputed forward; ring all-reduce moves
    2 (t - 1) / t of the message per GPU;
  * pipeline: one activation sent and one gradient sent per micro-batch and model chunk (v per rank), and
    with a calibration the schedule's own work per micro-batch and chunk (counted with the sends);
  * context parallel (cp ranks per sequence): the blocks compute on s / cp tokens (their queries attend to all
    s keys), the embeddings and head on all s, on every cp rank; per block the keys and values of every cp
    rank are all-gathered in forward and again in backward's recompute, and their gradients reduce-scattered,
    none of it overlapped; the last block's output is all-gathered, and the first block's input gradient.
A step is (m + (p - 1) / v) micro-batch times of the slowest rank: the bubble is (p - 1) / (v m) of the
ideal time (Narayanan et al. 2021, section 2.2); the zero-bubble schedule is taken to leave a third of it
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism": ZB-H1). Data-parallel gradient reduction (all-reduce,
or reduce-scatter + all-gather under ZeRO) overlaps with the last micro-batch's backward; what does not fit
in it is exposed. Under HSDP the reduce-scatter and all-gather run within a shard group (within a node) and
each rank's gradient shard is then all-reduced across the replicas; ZeRO's memory and optimizer work divide by
the shard group, not all of dp. The optimizer step reads and writes the rank's Adam state at memory bandwidth.

With a :class:`~lightning_3d.planner.calibration.Calibration` the same terms take measured speeds instead
(and, where CPU ranks outnumber the host's cores, idle stages leave their cores to busy ones -- a pipeline's
step is the ranks' average work plus (1 - 1/P) of its critical path at a core per rank, Graham's bound for
list scheduling on P cores -- and no data-parallel call hides behind backward, no core being free to run it):
a block's forward + backward is its measured seconds per token at the micro-batch size, divided by tp (the
tp split divides its matmuls), a recomputed block adds its measured recompute share of that (a third, a
forward, where not measured), the head its measured time / tp (where the calibration timed the block or the
head split over tp, what it measured: the even split counts as compute, the rest -- their collectives and
whatever the split adds -- as tensor-parallel communication);
DistributedDataParallel's gradient synchronization its measured cost per byte where timed (its hooks and bucket
copies with its all-reduces); every other collective costs its link's latency once per ring step + wire bytes /
bandwidth (all-gather and reduce-scatter at their own speeds where the calibration timed them apart from the
all-reduce), so latency counts per call and grows with the group: 2 (k - 1) steps for an all-reduce over k ranks
(as a reduce-scatter and an all-gather, the pair sequence parallelism makes of a tp region), k - 1 for an
all-gather or reduce-scatter, one per send; one data-parallel call per FSDP unit (a block, or the rest of the
stage) and per direction, or per 25 MiB bucket of DDP; the optimizer step, its measured time per parameter, plus
where the parameters are DTensors (tp > 1, or FSDP2 over dp under a pipeline or ZeRO) the measured cost of
DTensor's dispatch per block (FSDP unit) of them; and where data parallelism wraps each block with FSDP2 (dp > 1
under a pipeline, tensor parallelism or ZeRO), the measured cost of its hooks per block and micro-batch.

``compile=True`` (torch.compile per block) is not modelled: the terms are eager's, and the speed a compiled
block gains (fused non-matmul work, fewer kernel launches) is assumed, not estimated (``COMPILE_ASSUMED``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_3d.parallel.data_parallel import zero_stage_that_runs
from lightning_3d.planner.calibration import Calibration
from lightning_3d.planner.links import latency_steps, wire_bytes
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import (Precision, block_activation_bytes, block_parameters, checkpointed_blocks,
                                         gathered_param_bytes, rank_blocks, rank_parameters, stage_blocks)
from lightning_3d.planner.model import ModelSpec, PlannerError

ELEMENTWISE_PASSES = 3
"""Memory traffic of a block's non-matmul work, in units of the activations it saves: each saved tensor is
written in forward, read in backward, and its gradient written (an estimate; fused kernels move less)."""

DDP_BUCKET_BYTES = 25 * 2**20
"""``DistributedDataParallel``'s default bucket (25 MiB): one all-reduce call per bucket."""

COMPILE_ASSUMED = ("compile=True: step times are eager estimates; torch.compile's speed-up is assumed, not"
                   " modelled (benchmarks/compile_vs_eager.py measures it on these devices)")
"""What the planner's report and the YAML it writes say when the run compiles its blocks."""

ZERO_BUBBLE_SHARE = 1 / 3
"""The share of 1F1B's bubble the zero-bubble schedule leaves (ZB-H1; an estimate for PyTorch's version)."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest GPU, split by cause, and what it achieves."""

    compute: float
    tp_communication: float
    cp_communication: float
    ep_communication: float
    """Expert parallel's all-to-alls: tokens to their experts' ranks and back."""
    pp_bubble: float
    pp_communication: float
    dp_communication: float
    """Exposed (not hidden behind backward)."""
    optimizer: float
    model_flops: float
    """FLOPs of one step for the whole model without recompute (the MFU numerator)."""
    hardware_flops: float
    """FLOPs actually computed, recompute included (Narayanan et al.'s count)."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp_communication + self.cp_communication + self.ep_communication + self.pp_bubble
                + self.pp_communication + self.dp_communication + self.optimizer)

    def accumulated(self, batches: int, *, data_parallel_once: bool = True) -> "StepTime":
        """An optimizer step over ``batches`` batches, as Lightning's ``accumulate_grad_batches`` runs it: each
        batch's compute and tensor- and pipeline-parallel time (its own schedule, bubble included) that many
        times, the optimizer's update once, and the data-parallel synchronization once where the batches before
        the last skip it whole (DDP, FSDP2's replicate). Under ZeRO (``data_parallel_once=False``) each batch
        still gathers the sharded parameters, and it is counted per batch."""
        if batches == 1:
            return self
        return replace(self, compute=batches * self.compute, tp_communication=batches * self.tp_communication,
                       cp_communication=batches * self.cp_communication,
                       ep_communication=batches * self.ep_communication,
                       pp_bubble=batches * self.pp_bubble, pp_communication=batches * self.pp_communication,
                       dp_communication=(1 if data_parallel_once else batches) * self.dp_communication,
                       model_flops=batches * self.model_flops, hardware_flops=batches * self.hardware_flops)


def block_forward_flops(model: ModelSpec, tokens: int) -> float:
    """Matmul FLOPs of one block's forward over ``tokens`` = b s tokens (2 per multiply-add); for a measured
    model, its measured FLOPs per token."""
    if model.measured is not None:
        return model.measured.block_flops_per_token * tokens
    h, s = model.hidden_size, model.seq_length
    projections = 2 * tokens * h * (2 * h + 2 * model.kv_size)  # q, o; k, v
    # (with experts: each token's experts and the shared MLP, not every expert; and the router)
    mlp = 2 * tokens * h * (model.active_ffn * (3 if model.gated_mlp else 2) + model.num_experts)
    attention = 2 * 2 * tokens * s * h  # Q K^T and the product with V, full (Narayanan et al. count)
    return projections + mlp + attention


def head_forward_flops(model: ModelSpec, tokens: int) -> float:
    """FLOPs of the output head's forward (for a measured model: everything outside the blocks)."""
    if model.measured is not None:
        return model.measured.head_flops_per_token * tokens
    return 2 * tokens * model.hidden_size * model.vocab_size


def step_flops(model: ModelSpec, global_batch_size: int, recompute: str | None = None) -> float:
    """FLOPs of one step over ``global_batch_size`` sequences: 3 x forward, plus a block forward per
    recomputed block. With full recompute this is Narayanan et al.'s 96 B s l h^2 (1 + s/6h + V/16lh)."""
    tokens = global_batch_size * model.seq_length
    layout = Layout(recompute=recompute)
    recomputed = len(checkpointed_blocks(model, layout))
    return (3 * (model.num_layers * block_forward_flops(model, tokens) + head_forward_flops(model, tokens))
            + recomputed * block_forward_flops(model, tokens))


def estimate_step_time(model: ModelSpec, layout: Layout, cluster: Cluster, precision: Precision, *,
                       dp_overlap: bool = True, dp_reduce_bytes: int | None = None,
                       calibration: Calibration | None = None) -> StepTime:
    """Seconds of one optimizer step of ``layout`` (see the module docstring for the model).

    ``dp_overlap``: whether gradient reduction overlaps with backward (FSDP2 and DDP do; Megatron-LM of
    2021 reduced after backward; nothing does where the calibration leaves no core free to run it).
    ``dp_reduce_bytes``: bytes per gradient element on the wire (default the precision's gradient bytes;
    Megatron-LM reduces its fp32 main gradients: 4). ``calibration``: measured
    speeds to use instead of the cluster's datasheet figures (needed when the cluster has no peak)."""
    t, p, m, v, cp = layout.tp, layout.pp, layout.num_microbatches, layout.virtual_stages, layout.cp
    d = layout.dp_cp  # the ranks that average gradients: dp x cp
    tokens = layout.micro_batch_size * model.seq_length
    speeds = _Speeds(model, layout, cluster, precision, calibration)
    dp_overlap = dp_overlap and (calibration is None or calibration.communication_overlaps_compute)
    ckpt = checkpointed_blocks(model, layout)
    message = tokens * model.hidden_size * precision.activation_bytes  # one b s h activation
    part = message / cp  # the same, of the blocks' part of each sequence (all of it without cp)
    sp = layout.sequence_parallel
    zero = zero_stage_that_runs(layout.zero_stage, p > 1)[0]  # what lightning-3d runs (1 as 2; 3 as 2 under pp)
    fsdp = d > 1 and (p > 1 or t > 1 or zero > 0)  # FSDP2 per block; else DistributedDataParallel or none
    # ZeRO over the whole world, as the calibration timed it on a stand-in of the model's units: the step's
    # collectives, their waits and FSDP2's hooks in one figure per gradient byte.
    zero_sync = (getattr(calibration, f"zero{zero}_sync_seconds_per_byte", None)
                 if calibration is not None and zero and t == 1 and p == 1 and m == 1 and d > 1
                 and layout.replicas == 1 else None)

    def tp_collectives(regions: int, nbytes: float) -> float:
        # A region's all-reduce is, with SP, a reduce-scatter and an all-gather: the same bytes, two calls.
        if sp:
            return regions * (speeds.collective("tp", "reduce_scatter", nbytes, t)
                              + speeds.collective("tp", "all_gather", nbytes, t))
        return regions * speeds.collective("tp", "all_reduce", nbytes, t)

    # Context parallel, per block: keys and values gathered in forward and in the recompute, their gradients
    # reduce-scattered; at the ends of the blocks the stream (of this tp rank, under SP) gathered once.
    kv = tokens * model.kv_size / t * precision.activation_bytes
    cp_block = 2 * (2 * speeds.collective("cp", "all_gather", kv, cp) + speeds.collective("cp", "reduce_scatter", kv, cp))
    cp_end = speeds.collective("cp", "all_gather", tokens * model.hidden_size * precision.residual_bytes
                               / (t if sp else 1), cp)

    # Expert parallel, per block: each (token, expert) pair's hidden state sent to its expert's rank and the
    # output sent back, in forward, backward and a recompute: all-to-alls over ep.
    routed = part * model.experts_per_token
    ep_block = speeds.collective("ep", "all_to_all", routed, layout.ep) if layout.ep > 1 else 0.0

    per_rank = []  # (compute, tp comm, backward compute, cp comm, ep comm) of one micro-batch, per pipeline rank
    first_stage = stage_blocks(model, layout)[0]
    for rank in range(p):
        blocks = rank_blocks(model, layout, rank)
        recomputed = len(ckpt & set(blocks))
        compute = len(blocks) * speeds.block + recomputed * speeds.recompute + (rank == p - 1) * speeds.head
        if layout.schedule == "zero_bubble" and p > 1:  # the first stage's backward is whole
            compute += (len(blocks) - (rank == 0) * len(first_stage)) * speeds.zero_bubble_split
        if zero_sync is None:  # FSDP2's hooks: each block, the stage's root
            compute += fsdp * (len(blocks) + 1) * speeds.fsdp_call
        head_timed = rank == p - 1 and speeds.tp_head_extra is not None  # its collectives in its measured time
        ends = (rank == 0) + (rank == p - 1 and not head_timed)  # the embedding's and the head's regions
        if speeds.tp_block_extra is None:
            tp_time = tp_collectives(4 * len(blocks) + 2 * recomputed, part) + tp_collectives(ends, message)
        else:  # the blocks' collectives are in their measured time; a recompute repeats a forward's third
            tp_time = (len(blocks) + recomputed / 3) * speeds.tp_block_extra + tp_collectives(ends, message)
        if head_timed:
            tp_time += speeds.tp_head_extra
        cp_time = (len(blocks) * cp_block + ((rank == 0) + (rank == p - 1)) * cp_end) if cp > 1 else 0.0
        ep_time = (4 * len(blocks) + 2 * recomputed) * ep_block
        per_rank.append((compute, tp_time, compute * 2 / 3, cp_time, ep_time))
    slowest = max(range(p), key=lambda r: per_rank[r][0] + per_rank[r][1] + per_rank[r][3] + per_rank[r][4])
    compute, tp_comm, backward, cp_comm, ep_comm = per_rank[slowest]
    # Each of a rank's v model chunks receives its input and sends its output once per micro-batch, forward
    # and backward: interleaving multiplies the point-to-point traffic by v (Narayanan et al. 2021, 2.2.2).
    send = 2 * v * speeds.collective("pp", "send", part / (t if sp else 1), p)
    send += v * speeds.pipeline_microbatch if p > 1 else 0.0  # the schedule's own work per chunk and micro-batch
    microbatch = compute + tp_comm + cp_comm + ep_comm + send
    bubble_share = (ZERO_BUBBLE_SHARE if layout.schedule == "zero_bubble" else 1.0) * (p - 1) / v
    bubble = bubble_share * microbatch
    cores = calibration.host_cores_per_rank if calibration is not None else None
    if cores is not None and cores < 1 and p > 1:
        # The ranks outnumber the host's cores (and the micro-batch times were measured with all of them busy):
        # the cores go wherever there is work, so a stage idle in the bubble, or lighter than the slowest one,
        # leaves its core time to the busy ones. A step is then bounded as list scheduling is (Graham 1969): the
        # ranks' average busy work at the shared pace, plus (1 - 1/P) of the critical path at a core per rank,
        # P the host's cores per rank thread.
        host_cores = cores * cluster.gpus_per_node
        compute = sum(parts[0] for parts in per_rank) / p
        tp_comm = sum(parts[1] for parts in per_rank) / p
        cp_comm = sum(parts[3] for parts in per_rank) / p
        ep_comm = sum(parts[4] for parts in per_rank) / p
        bubble = (1 - 1 / max(host_cores, 1.0)) * (m + bubble_share) * microbatch * cores

    # Data parallel: gradients reduced once per step (all-reduce; reduce-scatter + all-gather of the new
    # parameters under ZeRO: the same bytes), overlapped with the last micro-batch's backward.
    busiest = max(range(p), key=lambda r: rank_parameters(model, layout, r))
    params = rank_parameters(model, layout, busiest)
    units = len(rank_blocks(model, layout, busiest)) + 1  # FSDP units: each block, and the rest of the stage
    grads = params * (dp_reduce_bytes or precision.grad_bytes)
    weights = params * gathered_param_bytes(layout, precision)  # bf16 under bf16-mixed: FSDP2 casts them

    def dp_call(collective: str, nbytes: float) -> float:  # one unit's share
        if zero and layout.replicas > 1 and collective != "all_reduce":  # HSDP: ZeRO within a shard group
            return speeds.collective("dp_shard", collective, nbytes / units, layout.shard)
        return speeds.collective("dp", collective, nbytes / units, d)

    def across_replicas(nbytes: float) -> float:  # HSDP: a unit's gradient shard all-reduced over the replicas
        if not (zero and layout.replicas > 1):
            return 0.0
        return speeds.collective("dp_replicate", "all_reduce", nbytes / units / layout.shard, layout.replicas)

    def dp_calls(collective: str, nbytes: float) -> float:
        return units * dp_call(collective, nbytes)

    if zero and p > 1 and layout.pipeline_reduce_grads == "per_microbatch":
        # A reduce-scatter of the stage's gradients in each micro-batch, each overlapping that backward.
        scatter = dp_calls("reduce_scatter", grads) + units * across_replicas(grads)
        gather = dp_calls("all_gather", weights)
        dp_time = m * scatter + gather
        exposed = m * max(0.0, scatter - backward) + max(0.0, gather - backward) if dp_overlap else dp_time
    else:
        # Overlap hides a call only behind compute that runs while it is in flight: the reduction of the last
        # gradients (the last bucket or unit, after the last backward) has none, nor under ZeRO the first
        # unit's gather (before the first forward); at least these are exposed.
        if zero_sync is not None:  # as FSDP2 runs it, measured
            dp_time = grads * zero_sync
            unhidden = dp_time / units
        elif zero:
            unhidden = dp_call("reduce_scatter", grads) + across_replicas(grads) + dp_call("all_gather", weights)
            dp_time = units * unhidden
        elif t == 1 and p == 1:  # DistributedDataParallel: one all-reduce per bucket
            buckets = max(1, math.ceil(grads / DDP_BUCKET_BYTES))
            unhidden = speeds.collective("dp", "all_reduce", grads / buckets, d)
            dp_time = buckets * unhidden
            if calibration is not None and calibration.ddp_sync_seconds_per_byte is not None and d > 1:
                dp_time = grads * calibration.ddp_sync_seconds_per_byte  # as DDP runs it, measured
                unhidden = dp_time / buckets
        else:  # FSDP2's replicate: one all-reduce per unit
            unhidden = dp_call("all_reduce", grads)
            dp_time = units * unhidden
        exposed = max(unhidden, dp_time - backward) if dp_overlap else dp_time
    if zero == 3 and d > 1 and zero_sync is None:
        # Without a pipeline FSDP2 gathers the parameters again for each micro-batch's forward and backward,
        # prefetched during the previous block's compute (where a collective can run beside it).
        gathers = 2 * dp_calls("all_gather", weights)
        exposed += m * (max(0.0, gathers - compute) if dp_overlap else gathers)
    in_blocks = len(rank_blocks(model, layout, busiest)) * block_parameters(model, layout)
    optimizer = speeds.optimizer(in_blocks, params - in_blocks) / (layout.shard if zero else 1)
    if t > 1 or fsdp:  # DTensor parameters (DDP's, and a lone pipeline stage's, are plain)
        optimizer += units * speeds.dtensor_optimizer_per_unit(1 / (t * (layout.shard if zero else 1)))
    return StepTime(
        compute=m * compute, tp_communication=m * tp_comm, cp_communication=m * cp_comm,
        ep_communication=m * ep_comm, pp_bubble=bubble,
        pp_communication=m * send, dp_communication=exposed, optimizer=optimizer,
        model_flops=step_flops(model, layout.global_batch_size),
        hardware_flops=step_flops(model, layout.global_batch_size, layout.recompute))


class _Speeds:
    """Seconds of the pieces a step is made of, on one rank of ``layout``: from the cluster's datasheet
    figures, or from a calibration's measurements."""

    def __init__(self, model: ModelSpec, layout: Layout, cluster: Cluster, precision: Precision,
                 calibration: Calibration | None) -> None:
        self.cluster, self.precision, self.calibration, self.layout = cluster, precision, calibration, layout
        t, tokens = layout.tp, layout.micro_batch_size * model.seq_length
        part = tokens // layout.cp  # what the blocks run on; the head runs on every token
        self.tp_block_extra: float | None = None
        """Where the block was timed split over tp: what the split adds to the even split (its collectives, its
        overheads), per block and micro-batch."""
        self.tp_head_extra: float | None = None
        """As ``tp_block_extra``, for the output head and loss split over the vocabulary, per micro-batch."""
        self.pipeline_microbatch = calibration.pipeline_microbatch_s if calibration is not None else 0.0
        """The pipeline schedule's own seconds per micro-batch and model chunk (measured; 0 from datasheets)."""
        self.zero_bubble_split = 0.0
        """What zero bubble's split backward adds to one block's forward + backward (measured; 0 unmeasured)."""
        self.fsdp_call = calibration.fsdp_block_call_s if calibration is not None else 0.0
        """What FSDP2's wrapping adds to one forward + backward of a block (measured; 0 from datasheets, as
        :meth:`dtensor_optimizer_per_unit`)."""
        if calibration is not None:
            self.block = calibration.block_seconds(layout.micro_batch_size) * part / t
            # a forward is a third of forward + backward (backward: 2 matmuls), unless measured
            share = calibration.recompute_share
            self.recompute = self.block * (1 / 3 if share is None else share)
            self.zero_bubble_split = calibration.zero_bubble_split_seconds(layout.micro_batch_size) * part
            self.head = calibration.head_seconds_per_token * tokens / t
            split_head = calibration.tp_head_seconds(layout.micro_batch_size, t) if t > 1 else None
            if split_head is not None:
                self.tp_head_extra = max(0.0, split_head * tokens - self.head)
            split = calibration.tp_block_seconds(layout.micro_batch_size, t) if t > 1 else None
            if split is not None:
                self.tp_block_extra = max(0.0, split * part - self.block)
            return
        if cluster.peak_tflops is None:
            raise PlannerError(f"The cluster has no peak ({cluster.device} ranks): give the planner a Calibration"
                               " (measured block time and link speeds) to estimate step times.")
        rate = cluster.peak_tflops * 1e12 * cluster.gemm_efficiency
        forward = block_forward_flops(model, part) / t / rate
        elementwise = ELEMENTWISE_PASSES * block_activation_bytes(model, layout, precision)
        self.block = 3 * forward + elementwise / (cluster.hbm_bandwidth_gbs * 1e9)
        self.recompute = forward
        self.head = 3 * head_forward_flops(model, tokens) / t / rate

    def collective(self, dimension: str, collective: str, nbytes: float, ranks: int) -> float:
        """Seconds of one ``collective`` of an ``nbytes`` tensor over ``ranks`` ranks of ``dimension``'s group."""
        wire = wire_bytes(collective, nbytes, ranks)
        if self.calibration is not None:
            # HSDP's two groups: dp's measured links (not calibrated apart); cp's group: tp's (the next ranks)
            # (ep's group: dp's ranks, their links)
            measured = ("dp" if dimension.startswith("dp") or dimension == "ep"
                        else "tp" if dimension == "cp" else dimension)
            link = self.calibration.link(measured, collective)
            return link.seconds(wire, latency_steps(collective, ranks))
        t, c, d = self.layout.tp, self.layout.cp, self.layout.dp
        # Mesh order (pp, dp, cp, tp): a tp group spans t consecutive ranks, a cp group t * c, a dp group
        # t * c * d, and neighbouring pipeline stages lie t * c * d ranks apart; under HSDP a shard group spans
        # t * shard ranks (shard fastest within dp), a replica group all of dp's; an ep group, consecutive dp
        # ranks, t * ep.
        span = {"tp": t, "cp": t * c, "dp": t * c * d, "pp": t * c * d + 1, "dp_shard": t * self.layout.shard,
                "dp_replicate": t * d, "ep": t * self.layout.ep}[dimension]
        return wire / self.cluster.bandwidth(span)

    def dtensor_optimizer_per_unit(self, local_share: float) -> float:
        """What an optimizer step costs more per block (FSDP unit) of DTensor parameters of which the rank holds
        ``local_share`` of the numbers: measured replicated and, where timed, as shards over the world,
        linear in the share between the two; 0 from datasheets, where GPU steps launch kernels for far longer
        than DTensor's dispatch takes."""
        c = self.calibration
        if c is None:
            return 0.0
        whole, sharded = c.optimizer_dtensor_seconds_per_block, c.optimizer_dtensor_seconds_per_sharded_block
        world = self.layout.world_size
        if sharded is None or world == 1:
            return whole
        return sharded + (whole - sharded) * (local_share - 1 / world) / (1 - 1 / world)

    def optimizer(self, in_blocks: float, outside: float) -> float:
        """Seconds of the optimizer step over ``in_blocks`` parameters of blocks and ``outside`` others
        (embeddings, final norm, head), before ZeRO's sharding."""
        c = self.calibration
        if c is not None and c.optimizer_seconds_per_parameter is not None:
            per_outside = c.optimizer_seconds_per_embedding_parameter
            return (in_blocks * c.optimizer_seconds_per_parameter
                    + outside * (c.optimizer_seconds_per_parameter if per_outside is None else per_outside))
        p = self.precision
        nbytes = 2 * (in_blocks + outside) * (p.param_bytes + p.grad_bytes + p.optimizer_bytes)
        return nbytes / (self.cluster.hbm_bandwidth_gbs * 1e9)
