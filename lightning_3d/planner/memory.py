"""The memory model: bytes one GPU holds for a layout, as parameters, gradients, optimizer state, activations.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3 and 5): with Psi parameters on a rank, mixed-precision Adam keeps 2 Psi (bf16 parameters)
+ 2 Psi (bf16 gradients) + K Psi (fp32 master weights, momentum, variance; K = 12). Over N_d data-parallel
ranks ZeRO-1 divides the optimizer state by N_d, ZeRO-2 the gradients too, ZeRO-3 the parameters too.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4): the tensors each block saves for backward, per micro-batch of b sequences of s tokens. With
2-byte activations, scores kept and dropout on, that is 34 sbh + 5 a s^2 b bytes per layer; tensor
parallelism divides all but 10 sbh of it by t (sequence parallelism divides the rest too). Pipeline
schedules multiply it by the micro-batches in flight on a rank (Narayanan et al. 2021): 1F1B keeps at most
p on the first stage, GPipe all m; interleaving v chunks keeps L (1 + (p - 1) / (p v)) layers' worth.

What lightning-3d itself does where it differs from those papers (each checked against what a CPU run
saves: tests/parity/test_planner_on_ranks.py):
  * attention runs through ``scaled_dot_product_attention``; its fused kernels keep the output and a
    log-sum-exp per head and token, never the (s x s) scores;
  * with sequence parallelism the all-gathered norm outputs that enter q/k/v and the MLP are saved whole
    (DTensor's all-gather is an autograd op); Megatron-LM saves the shard and gathers again in backward;
  * ``activation_checkpointing="selective"`` checkpoints every second block (not Megatron's "selective",
    which recomputes only the attention scores);
  * every ZeRO stage runs on FSDP2, which keeps parameters, gradients and optimizer state as dp shards at
    rest; stage 1 runs as stage 2, which (like stage 3 with pp > 1) keeps each block's parameters gathered
    from its forward to its backward, stage 3 alone regathers them per use; under "bf16-mixed" it gathers
    them in bf16 (``fsdp_casts_parameters``);
  * with pp > 1 a ZeRO stage holds its whole gradients (gathered over dp) from its first backward to the end
    of the step, as ``torch.distributed.pipelining`` reduce-scatters once, after the last micro-batch;
    ``pipeline_reduce_grads="per_microbatch"`` holds the shards plus the stage's root unit (embedding or
    head) and one block whole (``step_gradient_bytes``).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, fields

from lightning_3d.parallel.activation_checkpointing import SELECTIVE_EVERY
from lightning_3d.parallel.data_parallel import zero_stage_that_runs
from lightning_3d.pipeline.split import assign_blocks, stage_ids_of
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.model import ModelSpec, PlannerError


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per element of saved activations."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """Adam's state per parameter: the two moments, plus fp32 master weights when parameters are 16-bit."""
    activation_bytes: int
    """Tensors that matmuls read (autocast's compute dtype)."""
    residual_bytes: int
    """The residual stream and norm inputs (fp32 under autocast, where norms run in fp32)."""
    lightning: str
    """``Trainer(precision=...)`` of a run with these bytes."""


PRECISIONS = {
    p.name: p for p in (
        Precision("32-true", 4, 4, 8, 4, 4, "32-true"),
        # Lightning's autocast: fp32 weights, gradients and AdamW state; bf16 matmul inputs, fp32 residual.
        Precision("bf16-mixed", 4, 4, 8, 2, 4, "bf16-mixed"),
        # The ZeRO paper's mixed precision (fp16 in its day): 16-bit weights and gradients, fp32 master copy +
        # Adam (K = 12). Megatron-LM's fp16 runs (Narayanan et al. 2021) kept fp16 gradients.
        Precision("megatron-mixed", 2, 2, 12, 2, 2, "bf16-mixed"),
        # bf16 runs of Megatron-LM (which turns on --accumulate-allreduce-grads-in-fp32 with --bf16), DeepSpeed's
        # BF16_Optimizer (BLOOM) and Llama 3 ("FP32 gradient accumulation ... over multiple micro-batches",
        # section 3.3.2): gradients accumulate in an fp32 buffer, 4 bytes per parameter.
        Precision("megatron-bf16", 2, 4, 12, 2, 2, "bf16-mixed"),
    )
}
"""Precisions by name (``--precision``). "megatron-mixed" is the ZeRO paper's accounting, "megatron-bf16"
that of the published bf16 runs (docs/planner.md); a lightning-3d run has "32-true" or "bf16-mixed" (the
same 16 bytes per parameter, split 4 + 4 + 8)."""

INT64 = 8
FP32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU at its peak in a training step."""

    parameters: float
    """At rest, as ``lightning_3d.parallel.memory.memory_report`` counts them (this rank's shards)."""
    gradients: float
    optimizer_state: float
    activations: float
    """Saved for backward by the micro-batches in flight on this rank."""
    gathered: float
    """Transient: parameters FSDP2 holds gathered during the step, gradients it holds whole beyond their
    shards (ZeRO with pp > 1, ``step_gradient_bytes``), the block that recompute rebuilds, and autocast's bf16
    copies of the weights."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def zero_model_state_bytes(num_params: float, dp: int, zero_stage: int, precision: Precision) -> dict[str, float]:
    """Parameters, gradients and optimizer state per rank for ``num_params`` parameters replicated over ``dp``
    ranks, ZeRO stage 0-3 as the ZeRO paper defines them (Rajbhandari et al. 2020, Figure 1)."""
    if zero_stage not in (0, 1, 2, 3):
        raise PlannerError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
    return {
        "parameters": num_params * precision.param_bytes / (dp if zero_stage >= 3 else 1),
        "gradients": num_params * precision.grad_bytes / (dp if zero_stage >= 2 else 1),
        "optimizer_state": num_params * precision.optimizer_bytes / (dp if zero_stage >= 1 else 1),
    }


def rank_blocks(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple[int, ...]:
    """Indices of the blocks pipeline rank ``pp_rank`` holds: the even-by-count split lightning-3d makes
    (``pipeline_split="blocks"``), stage s on rank s % pp."""
    return _rank_blocks(model.num_layers, layout.pp, layout.virtual_stages, pp_rank)


@functools.lru_cache(maxsize=4096)
def _rank_blocks(num_layers: int, pp: int, virtual: int, pp_rank: int) -> tuple[int, ...]:
    stages = _stage_blocks(num_layers, pp, virtual)
    return tuple(b for s in stage_ids_of(pp_rank, pp, virtual) for b in stages[s])


@functools.lru_cache(maxsize=1024)
def stage_blocks(model: ModelSpec, layout: Layout) -> tuple[tuple[int, ...], ...]:
    """The blocks of each pipeline stage, stage by stage (pp x virtual_stages of them)."""
    return _stage_blocks(model.num_layers, layout.pp, layout.virtual_stages)


def _stage_blocks(num_layers: int, pp: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    # Cached: a search asks for the same split many times per layout, and assign_blocks logs uneven ones.
    split = assign_blocks([str(i) for i in range(num_layers)], pp * virtual)
    return tuple(tuple(int(b) for b in stage) for stage in split)


def block_parameters(model: ModelSpec, layout: Layout) -> float:
    """One block's parameters on one rank before data-parallel sharding: divided over tp where tensor
    parallelism splits them, and its experts over ep."""
    experts = model.expert_params().per_rank(layout.tp)
    return model.block_params().per_rank(layout.tp) - experts + experts / layout.ep


def rank_expert_parameters(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """Of :func:`rank_parameters`, the experts' (0 for a dense model): ZeRO shards them over dp / ep."""
    return len(rank_blocks(model, layout, pp_rank)) * model.expert_params().per_rank(layout.tp) / layout.ep


def sharded_parameters(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """:func:`rank_parameters` as ZeRO shards them: over ``layout.shard`` ranks, the experts over
    ``layout.expert_shard``."""
    experts = rank_expert_parameters(model, layout, pp_rank)
    return (rank_parameters(model, layout, pp_rank) - experts) / layout.shard + experts / layout.expert_shard


def rank_parameters(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """Parameters on one rank before data-parallel sharding: its blocks, the embeddings on the first pipeline
    rank, the final norm and head on the last, each divided over tp where tensor parallelism splits it, and
    the blocks' experts over ep."""
    count = len(rank_blocks(model, layout, pp_rank)) * block_parameters(model, layout)
    if pp_rank == 0:
        count += model.embedding_params().per_rank(layout.tp)
    if pp_rank == layout.pp - 1:
        count += model.head_params(layout.pp).per_rank(layout.tp)
    return count


def step_gradient_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> float:
    """The most gradient bytes pipeline rank ``pp_rank`` holds at once within a step (what a run logs as
    "gradients in step", ``lightning_3d.parallel.memory.step_gradient_bytes``). Without ZeRO: whole
    gradients. ZeRO without a pipeline: the shards (FSDP2 reduce-scatters each block's as its backward ends,
    counted as the shards here). ZeRO with pp > 1: whole gradients until the step's last backward, or with
    ``pipeline_reduce_grads="per_microbatch"`` the shards plus the root unit's and one block's whole."""
    params = rank_parameters(model, layout, pp_rank)
    whole = params * precision.grad_bytes
    shards = sharded_parameters(model, layout, pp_rank) * precision.grad_bytes
    if layout.zero_stage == 0 or layout.dp_cp == 1 or layout.pp == 1:
        return shards if layout.zero_stage else whole
    if layout.pipeline_reduce_grads == "per_step":
        return whole
    block = block_parameters(model, layout)
    root = params - len(rank_blocks(model, layout, pp_rank)) * block  # embeddings, final norm, head
    return shards + (root + block) * precision.grad_bytes


def block_activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, *, checkpointed: bool = False,
                           gathered_region_inputs: bool = True) -> float:
    """Bytes one block saves for backward per micro-batch on one tp rank (Korthikanti et al. 2022, section
    4.1, counted tensor by tensor; for a measured model, as measured). ``gathered_region_inputs``: with sequence parallelism, whether the
    all-gathered norm outputs are saved whole (lightning-3d, DTensor) or as shards (Megatron-LM).

    Under context parallelism the block runs on s / cp of each sequence's tokens, and its attention, which
    gathers every cp rank's keys and values, is recomputed in backward: it saves its q, k, v (this rank's
    part) and its output, never the gathered keys and values nor scores."""
    b, s, h, t, cp = layout.micro_batch_size, model.seq_length, model.hidden_size, layout.tp, layout.cp
    tokens = b * s // cp
    e, r = precision.activation_bytes, precision.residual_bytes
    seq_split = t if layout.sequence_parallel else 1
    if checkpointed:
        return tokens * h * r / seq_split  # the block's input, from which backward recomputes the rest
    if model.measured is not None:  # as measured, in the run's precision (MeasuredCosts), per token under cp
        return model.measured.block_bytes(b, t) / cp
    mask = 1 if model.dropout > 0 else 0  # bytes per element of a dropout mask
    stats = FP32 * (2 if model.norm == "layernorm" else 1)  # mean and 1/std (or 1/rms) per token
    # Between the tensor-parallel regions: two norm inputs (residual stream), their statistics (and outputs,
    # where the norm saves them), the masks of the dropouts on the two residual branches. Replicated over tp,
    # or split along the sequence with SP.
    between = 2 * tokens * (h * r * (1 + model.norm_output_saved) + stats + h * mask) / seq_split
    # The norm outputs entering the column-parallel layers of attention and MLP; under autocast each Linear
    # saves its own bf16 cast of its input, so separate q, k, v projections keep three copies.
    copies = 1 if model.fused_qkv or not _autocast(precision) else 3
    region_inputs = (copies + 1) * tokens * h * e / (t if layout.sequence_parallel and not gathered_region_inputs else 1)
    attention = tokens * (h + 2 * model.kv_size) * e / t  # q, k, v
    heads = model.num_heads / t
    if cp > 1:
        attention += tokens * h * e / t  # o's input (the attention's own tensors: recomputed)
    elif model.flash_attention:
        attention += tokens * h * e / t + tokens * heads * FP32  # output (o's input), log-sum-exp
    else:
        scores = b * heads * s * s
        attention += scores * e + mask * scores * (1 + e) + tokens * h * e / t  # softmax, dropout, o's input
    # The activation's input(s) and output; a GELU written as its formula saves three more.
    mlp = tokens * model.active_ffn * e / t * ((4 if model.gated_mlp else 2) + 3 * model.gelu_formula)
    if model.num_experts:  # each (token, expert) pair's hidden state at its expert, and the output it sends back
        mlp += 2 * tokens * model.experts_per_token * h * e
    return between + region_inputs + attention + mlp


def _autocast(precision: Precision) -> bool:
    """Whether matmuls read a lower-precision copy of their fp32 operands (autocast)."""
    return precision.activation_bytes < precision.param_bytes


def fsdp_casts_parameters(layout: Layout, precision: Precision) -> bool:
    """Whether FSDP2 gathers the parameters in autocast's dtype: lightning-3d's ZeRO layouts (dp > 1) under
    autocast ("bf16-mixed") give FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)``
    (``lightning_3d.parallel.precision``), so the gathered weights are bf16, the matmuls save them as they are
    and autocast, finding them in its dtype, copies none."""
    zero = zero_stage_that_runs(layout.zero_stage, layout.pp > 1)[0]
    return _autocast(precision) and zero > 0 and layout.dp_cp > 1


def gathered_param_bytes(layout: Layout, precision: Precision) -> int:
    """Bytes per parameter ZeRO all-gathers, on the wire and in memory."""
    return precision.activation_bytes if fsdp_casts_parameters(layout, precision) else precision.param_bytes


def autocast_weight_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> float:
    """Autocast's bf16 copies of the rank's matmul weights, cached from their first use in forward and saved for
    backward (everything but the embedding tables, which are looked up, not multiplied). None where FSDP2
    already gathers them in bf16 (``fsdp_casts_parameters``)."""
    if not _autocast(precision) or fsdp_casts_parameters(layout, precision):
        return 0.0
    params = rank_parameters(model, layout, pp_rank)
    if pp_rank == 0:
        params -= model.embedding_params().per_rank(layout.tp)
    return params * precision.activation_bytes


def checkpointed_blocks(model: ModelSpec, layout: Layout) -> set[int]:
    """Blocks whose activations are recomputed: all ("full"), every second one ("selective", counted over
    the whole model as ``lightning_3d.parallel.activation_checkpointing`` does) or none."""
    if layout.recompute == "full":
        return set(range(model.num_layers))
    if layout.recompute == "selective":
        return {i for i in range(model.num_layers) if i % SELECTIVE_EVERY == SELECTIVE_EVERY - 1}
    return set()


def chunk_activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> list[float]:
    """Bytes one micro-batch leaves saved in each of the rank's model chunks (``virtual_stages`` of them, in
    the order the rank runs them) when its forward there is done: the chunk's blocks, plus the token and
    position ids on the first stage, and the final norm and fp32 log-softmax of the loss (vocabulary-parallel:
    V / t per token) on the last."""
    b, s, h, t = layout.micro_batch_size, model.seq_length, model.hidden_size, layout.tp
    ckpt = checkpointed_blocks(model, layout)
    stages = _stage_blocks(model.num_layers, layout.pp, layout.virtual_stages)
    seq_split = t if layout.sequence_parallel else 1
    chunks = []
    for stage in stage_ids_of(pp_rank, layout.pp, layout.virtual_stages):
        total = sum(block_activation_bytes(model, layout, precision, checkpointed=i in ckpt) for i in stages[stage])
        if stage == 0 and 0 in ckpt and layout.cp > 1:
            # The first block's checkpoint keeps its input as it came, before the cut: the whole sequence.
            total += b * s * h * precision.residual_bytes / seq_split * (1 - 1 / layout.cp)
        if model.measured is not None:
            total += (b * model.measured.first_stage_bytes_per_sequence if stage == 0 else 0.0)
            total += (b * model.measured.last_stage_bytes_per_sequence + loss_activation_bytes(model, layout)
                      if stage == len(stages) - 1 else 0.0)
            chunks.append(total)
            continue
        if stage == 0:
            total += b * s * INT64 + s * INT64 * model.learned_positions + b * s * h * (model.dropout > 0) / seq_split
        if stage == len(stages) - 1:
            stats = FP32 * (2 if model.norm == "layernorm" else 1)
            norm = h * precision.residual_bytes * (1 + model.norm_output_saved) + stats  # input (and output)
            total += (b * s * norm / seq_split  # the final norm's
                      + b * s * h * precision.activation_bytes  # its output, gathered, into the head
                      + loss_activation_bytes(model, layout))
        chunks.append(total)
    return chunks


def loss_activation_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes the loss saves per micro-batch on the last stage: the fp32 log-softmax (vocabulary-parallel: V / t
    per token) and the targets. No weight lies above them, so zero bubble's input gradient frees them."""
    tokens = layout.micro_batch_size * model.seq_length
    return tokens * model.vocab_size / layout.tp * FP32 + tokens * INT64


def chunk_input_gradient_frees(model: ModelSpec, layout: Layout, pp_rank: int) -> list[float]:
    """Of ``chunk_activation_bytes``, what zero bubble's input gradient frees in each chunk: the loss on the
    last stage (the nodes above the head's matmul, the graph's highest with a weight), nothing elsewhere."""
    last = layout.pp * layout.virtual_stages - 1
    return [loss_activation_bytes(model, layout) if stage == last else 0.0
            for stage in stage_ids_of(pp_rank, layout.pp, layout.virtual_stages)]


def microbatch_activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> float:
    """Bytes one micro-batch leaves saved on pipeline rank ``pp_rank`` through all of its chunks."""
    return sum(chunk_activation_bytes(model, layout, precision, pp_rank))


def peak_activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> float:
    """The most activation bytes the rank holds at once in a step, following its schedule's order of
    forwards and backwards chunk by chunk: the embedding, the head and the chunks of an uneven split count as
    often as they are in flight, not as an average chunk."""
    chunks = chunk_activation_bytes(model, layout, precision, pp_rank)
    if layout.pp == 1 or layout.schedule in ("gpipe", "1f1b"):
        return microbatches_in_flight(layout, pp_rank) * sum(chunks)
    zero_bubble = layout.schedule == "zero_bubble"
    return interleaved_peak(chunks, layout.num_microbatches, layout.pp, pp_rank, zero_bubble=zero_bubble,
                            input_gradient_frees=chunk_input_gradient_frees(model, layout, pp_rank) if zero_bubble
                            else None)


def interleaved_peak(chunk_bytes: list[float], num_microbatches: int, pp: int, pp_rank: int, *,
                     zero_bubble: bool = False, input_gradient_frees: list[float] | None = None) -> float:
    """The most bytes a rank of an interleaved schedule holds at once, when a micro-batch leaves
    ``chunk_bytes[c]`` saved in its chunk c (in the order the rank runs them).

    PyTorch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (torch.distributed.pipelining:
    _get_warmup_ops, _get_1f1b_rank_ops), as Megatron-LM's: micro-batches go in rounds of ``per_round``; the
    warm-up runs (v - 1) per_round + k (p - 1 - rank) chunk forwards (k = 2; 1 for zero bubble), then each step
    one forward and one backward. Forwards walk chunks 0 .. v - 1 round by round, backwards v - 1 .. 0; the
    peak is right after a forward. Interleaved 1F1B's backward frees its chunk's saved tensors. Zero bubble's
    computes the input's gradient only (``autograd.grad`` with ``retain_graph``): it frees what lies above the
    chunk's highest matmul, ``input_gradient_frees[c]`` (the loss on the last stage); the rest stays until the
    weight gradient, which rank r runs r backwards later. The last rank's last chunk then holds two
    micro-batches, one of them without its loss, where interleaved 1F1B holds one
    (``tests/parity/test_planner_on_ranks.py`` compares the walk with what each rank holds)."""
    m, p, v = num_microbatches, pp, len(chunk_bytes)
    frees_early = input_gradient_frees if zero_bubble and input_gradient_frees else [0.0] * v
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - pp_rank), m * v)
    deferred = pp_rank if zero_bubble else 0
    live = peak = 0.0
    held: list[float] = []  # what backwards left for their weight gradients, oldest first
    for op in range(m * v):
        live += chunk_bytes[(op // per_round) % v]
        peak = max(peak, live)
        if op >= warmup:
            chunk = v - 1 - ((op - warmup) // per_round) % v
            live -= frees_early[chunk]
            held.append(chunk_bytes[chunk] - frees_early[chunk])
            if op - warmup >= deferred:
                live -= held.pop(0)
    return peak


def microbatches_in_flight(layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations a rank holds at its peak, in units of one micro-batch through all of
    the rank's blocks, for chunks of equal size (``peak_activation_bytes`` follows the real chunks). GPipe:
    all m. 1F1B: pp - rank (at most m), the warm-up forwards plus the one that starts the steady state.
    Interleaved (v chunks, PyTorch's and Megatron-LM's warm-up of (v - 1) p + 2 (p - 1 - rank) chunk
    forwards, plus one): that many chunks, each 1/v of the rank's blocks; on the first rank p + (p - 1) / v,
    Korthikanti et al.'s L (1 + (p - 1) / (p v)) layers' worth (section 4.2.3)."""
    m, p, v = layout.num_microbatches, layout.pp, layout.virtual_stages
    if p == 1:
        return 1  # one forward and backward per micro-batch (gradient accumulation frees each graph)
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "1f1b":
        return min(m, p - pp_rank)
    return min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1) / v


def estimate_memory(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> MemoryEstimate:
    """Peak bytes on a GPU of pipeline rank ``pp_rank`` (any dp and tp rank: they hold the same amounts)."""
    params = rank_parameters(model, layout, pp_rank)
    # lightning-3d runs every ZeRO stage through FSDP2 (lightning_3d.parallel.data_parallel.apply_zero): at rest
    # parameters, gradients and optimizer state are all dp shards, as in ZeRO-3; stage 2 differs from 3 in
    # keeping the parameters gathered from forward to backward ("gathered" below). Modelled: the stage that runs
    # (1 runs as 2, and 3 as 2 under the pipeline).
    zero = zero_stage_that_runs(layout.zero_stage, layout.pp > 1)[0]
    # Dense weights over the shard group (HSDP: its own), experts over the ranks that hold the same ones.
    experts = rank_expert_parameters(model, layout, pp_rank)
    states = {name: dense + routed for (name, dense), routed in zip(
        zero_model_state_bytes(params - experts, layout.shard, 3 if zero else 0, precision).items(),
        zero_model_state_bytes(experts, layout.expert_shard, 3 if zero else 0, precision).values())}
    blocks = rank_blocks(model, layout, pp_rank)
    block_params = block_parameters(model, layout)
    gathered = 0.0
    gather_bytes = gathered_param_bytes(layout, precision)
    if layout.shard > 1 and zero == 2:
        # Every block gathered until backward; a bf16 gather is new memory beside the rank's own fp32 shard.
        own_shard = 0.0 if fsdp_casts_parameters(layout, precision) else 1 / layout.shard
        gathered = params * gather_bytes * (1 - own_shard)
    elif layout.shard > 1 and zero == 3:
        gathered = 2 * block_params * gather_bytes  # the block in use and the one prefetched
    gathered += step_gradient_bytes(model, layout, precision, pp_rank) - states["gradients"]
    if checkpointed_blocks(model, layout) & set(blocks):
        gathered += block_activation_bytes(model, layout, precision)  # one block rebuilt in backward
    gathered += autocast_weight_bytes(model, layout, precision, pp_rank)
    activations = peak_activation_bytes(model, layout, precision, pp_rank)
    return MemoryEstimate(parameters=states["parameters"], gradients=states["gradients"],
                          optimizer_state=states["optimizer_state"], activations=activations, gathered=gathered)


def peak_memory(model: ModelSpec, layout: Layout, precision: Precision) -> tuple[int, MemoryEstimate]:
    """The pipeline rank that needs the most memory, and its estimate."""
    estimates = [estimate_memory(model, layout, precision, r) for r in range(layout.pp)]
    rank = max(range(layout.pp), key=lambda r: estimates[r].total)
    return rank, estimates[rank]
