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
  * pipeline: one activation sent and one gradient sent per micro-batch and model chunk (v per rank).
A step is (m + (p - 1) / v) micro-batch times of the slowest rank: the bubble is (p - 1) / (v m) of the
ideal time (Narayanan et al. 2021, section 2.2); the zero-bubble schedule is taken to leave a third of it
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism": ZB-H1). Data-parallel gradient reduction (all-reduce,
or reduce-scatter + all-gather under ZeRO) overlaps with the last micro-batch's backward; what does not fit
in it is exposed. The optimizer step reads and writes the rank's Adam state at memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.parallel.data_parallel import zero_stage_that_runs
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import Precision, block_activation_bytes, checkpointed_blocks, rank_blocks, rank_parameters
from lightning_3d.planner.model import ModelSpec

ELEMENTWISE_PASSES = 3
"""Memory traffic of a block's non-matmul work, in units of the activations it saves: each saved tensor is
written in forward, read in backward, and its gradient written (an estimate; fused kernels move less)."""

ZERO_BUBBLE_SHARE = 1 / 3
"""The share of 1F1B's bubble the zero-bubble schedule leaves (ZB-H1; an estimate for PyTorch's version)."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest GPU, split by cause, and what it achieves."""

    compute: float
    tp_communication: float
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
        return (self.compute + self.tp_communication + self.pp_bubble + self.pp_communication
                + self.dp_communication + self.optimizer)


def block_forward_flops(model: ModelSpec, tokens: int) -> float:
    """Matmul FLOPs of one block's forward over ``tokens`` = b s tokens (2 per multiply-add)."""
    h, s = model.hidden_size, model.seq_length
    projections = 2 * tokens * h * (2 * h + 2 * model.kv_size)  # q, o; k, v
    mlp = 2 * tokens * h * model.ffn * (3 if model.gated_mlp else 2)
    attention = 2 * 2 * tokens * s * h  # Q K^T and the product with V, full (Narayanan et al. count)
    return projections + mlp + attention


def head_forward_flops(model: ModelSpec, tokens: int) -> float:
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
                       dp_overlap: bool = True, dp_reduce_bytes: int | None = None) -> StepTime:
    """Seconds of one optimizer step of ``layout`` (see the module docstring for the model).

    ``dp_overlap``: whether gradient reduction overlaps with backward (FSDP2 and DDP do; Megatron-LM of
    2021 reduced after backward). ``dp_reduce_bytes``: bytes per gradient element on the wire (default the
    precision's gradient bytes; Megatron-LM reduces its fp32 main gradients: 4)."""
    t, p, d, m, v = layout.tp, layout.pp, layout.dp, layout.num_microbatches, layout.virtual_stages
    tokens = layout.micro_batch_size * model.seq_length
    flops_rate = cluster.peak_tflops * 1e12 * cluster.gemm_efficiency
    hbm = cluster.hbm_bandwidth_gbs * 1e9
    ckpt = checkpointed_blocks(model, layout)
    message = tokens * model.hidden_size * precision.activation_bytes  # one b s h activation
    tp_bw = cluster.bandwidth(t)
    # pp is the outermost mesh dimension: neighbouring stages are t * d global ranks apart.
    pp_bw = cluster.bandwidth(t * d + 1)
    # dp sits inside pp: a dp group spans t * d consecutive ranks.
    dp_bw = cluster.bandwidth(t * d)

    def allreduce(nbytes: float, ranks: int, bandwidth: float) -> float:
        return 2 * (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0

    per_rank = []  # (compute, tp comm, backward compute) of one micro-batch, per pipeline rank
    for rank in range(p):
        blocks = rank_blocks(model, layout, rank)
        recomputed = len(ckpt & set(blocks))
        flops = (3 * len(blocks) + recomputed) * block_forward_flops(model, tokens)
        if rank == p - 1:
            flops += 3 * head_forward_flops(model, tokens)
        elementwise = ELEMENTWISE_PASSES * len(blocks) * block_activation_bytes(model, layout, precision)
        compute = flops / t / flops_rate + elementwise / hbm
        collectives = (4 * len(blocks) + 2 * recomputed + (rank == 0) + (rank == p - 1))
        per_rank.append((compute, collectives * allreduce(message, t, tp_bw), compute * 2 / 3))
    slowest = max(range(p), key=lambda r: per_rank[r][0] + per_rank[r][1])
    compute, tp_comm, backward = per_rank[slowest]
    # Each of a rank's v model chunks receives its input and sends its output once per micro-batch, forward
    # and backward: interleaving multiplies the point-to-point traffic by v (Narayanan et al. 2021, 2.2.2).
    send = 2 * v * message / (t if layout.sequence_parallel else 1) / pp_bw if p > 1 else 0.0
    microbatch = compute + tp_comm + send
    bubble_share = (ZERO_BUBBLE_SHARE if layout.schedule == "zero_bubble" else 1.0) * (p - 1) / v

    # Data parallel: gradients reduced once per step (all-reduce; reduce-scatter + all-gather of the new
    # parameters under ZeRO: the same bytes), overlapped with the last micro-batch's backward.
    params = max(rank_parameters(model, layout, r) for r in range(p))
    grads = params * (dp_reduce_bytes or precision.grad_bytes)
    zero = zero_stage_that_runs(layout.zero_stage, p > 1)[0]  # what lightning-3d runs (1 as 2; 3 as 2 under pp)
    if zero and p > 1 and layout.pipeline_reduce_grads == "per_microbatch":
        # A reduce-scatter of the stage's gradients in each micro-batch, each overlapping that backward.
        scatter, gather = allreduce(grads, d, dp_bw) / 2, allreduce(params * precision.param_bytes, d, dp_bw) / 2
        dp_time = m * scatter + gather
        exposed = m * max(0.0, scatter - backward) + max(0.0, gather - backward) if dp_overlap else dp_time
    else:
        dp_time = allreduce(grads if zero == 0 else (grads + params * precision.param_bytes) / 2, d, dp_bw)
        exposed = max(0.0, dp_time - backward) if dp_overlap else dp_time
    if zero == 3 and d > 1:
        # Without a pipeline FSDP2 gathers the parameters again for each micro-batch's forward and backward,
        # prefetched during the previous block's compute.
        gathers = allreduce(params * precision.param_bytes, d, dp_bw)  # two all-gathers: one all-reduce's bytes
        exposed += m * max(0.0, gathers - compute)
    optimizer = 2 * params * (precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes) / hbm
    if zero:
        optimizer /= d
    return StepTime(
        compute=m * compute, tp_communication=m * tp_comm, pp_bubble=bubble_share * microbatch,
        pp_communication=m * send, dp_communication=exposed, optimizer=optimizer,
        model_flops=step_flops(model, layout.global_batch_size),
        hardware_flops=step_flops(model, layout.global_batch_size, layout.recompute))
