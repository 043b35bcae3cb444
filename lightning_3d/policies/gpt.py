"""Policy for the reference GPT (``lightning_3d.models.GPT``): Megatron-style tensor and sequence parallel.

Per block, without sequence parallelism (the Megatron count: two all-reduces forward, two backward)::

    attn   input stays a replicated DTensor   -> one all-reduce of its gradient in backward (q, k, v share it)
    q/k/v  column-wise (heads split over tp)  -> no communication
    o_proj row-wise                           -> all-reduce of the output in forward
    mlp    like attn; up_proj column-wise, down_proj row-wise

With sequence parallelism the activations between those regions stay split along the sequence: LayerNorms
run on sequence shards, the all-reduces become a reduce-scatter (after o_proj/down_proj) and an all-gather
(entering attn/mlp), and their mirror images in backward.

The token embedding is vocabulary-parallel (row-wise over the vocabulary); the output head is column-wise
over the vocabulary and, with ``vocab_parallel_loss``, keeps its logits sharded so the cross-entropy is
computed on the shards (see ``lightning_3d.parallel.loss``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_3d.errors import LayoutError
from lightning_3d.common import join_fqn
from lightning_3d.policies.base import Plan, PlanOptions, Policy, PolicyError, find_submodule
from lightning_3d.policies.registry import register_policy


@register_policy("gpt")
class GPTPolicy(Policy):
    model_classes = ("lightning_3d.models.gpt.GPT",)

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        prefix = find_submodule(root, self.model_classes)
        if prefix is None:
            raise PolicyError(
                f"policy='gpt' found no lightning_3d.models.GPT inside {type(root).__name__}."
                " Use policy='auto' for other models."
            )
        gpt = root.get_submodule(prefix)
        stages = dict(
            blocks=[join_fqn(prefix, f"blocks.{name}") for name in gpt.blocks.keys()],
            pipeline_root=prefix,
            before=[join_fqn(prefix, n) for n in ("tok_emb", "pos_emb", "emb_dropout")],
            after=[join_fqn(prefix, n) for n in ("ln_f", "lm_head")],
        )
        if options.tp == 1:
            return Plan(**stages)
        _check_sizes(gpt.config, options)
        tp_plan = {join_fqn(prefix, name): style for name, style in gpt_tp_plan(options).items()}
        # Attention dropout acts on this rank's heads; with SP the residual and embedding dropout act on
        # this rank's sequence shard. Without SP those two see replicated data: default stream.
        sharded = ["blocks.*.attn"] if gpt.config.dropout > 0 else []
        if sharded and options.sequence_parallel:
            sharded += ["blocks.*.attn_dropout", "blocks.*.mlp_dropout", "emb_dropout"]
        return Plan(**stages, tp_plan=tp_plan, sharded_rng_regions=[join_fqn(prefix, n) for n in sharded])


def gpt_tp_plan(options: PlanOptions) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a GPT, relative to the GPT module."""
    sp = options.sequence_parallel
    # Between regions the activations are either replicated, or split along the sequence (dim 1) with SP.
    between = Shard(1) if sp else Replicate()
    head_output = dict(output_layouts=Shard(-1), use_local_output=False) if options.vocab_parallel_loss else (
        dict(output_layouts=Replicate())
    )
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, **head_output),
    }
    # A replicated input to a region stays a DTensor inside it, so q, k and v (up_proj) share one gradient
    # reduction at the region's boundary instead of one each.
    region_input = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
    for region, (first, last) in {"attn": (("q_proj", "k_proj", "v_proj"), "o_proj"),
                                  "mlp": (("up_proj",), "down_proj")}.items():
        plan[f"blocks.*.{region}"] = region_input
        for name in first:
            plan[f"blocks.*.{region}.{name}"] = ColwiseParallel()
        plan[f"blocks.*.{region}.{last}"] = RowwiseParallel(output_layouts=between)
    if sp:
        for norm in ("blocks.*.ln_1", "blocks.*.ln_2", "ln_f"):
            plan[norm] = SequenceParallel()
        # The position table stays replicated (it is small); its output is split along the sequence (dim 0
        # of a (T, C) tensor) locally, without communication, to add to the sequence-sharded token embeddings.
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    return plan


def _check_sizes(config, options: PlanOptions) -> None:
    tp = options.tp
    problems = []
    if config.n_head % tp:
        problems.append(f"n_head ({config.n_head}) is not divisible by tensor_parallel_size ({tp}): heads are"
                        " split whole across tp ranks")
    if config.vocab_size % tp:
        padded = -(-config.vocab_size // tp) * tp
        problems.append(f"vocab_size ({config.vocab_size}) is not divisible by tensor_parallel_size ({tp}): set"
                        f" vocab_size={padded} (the extra ids are never produced by the data)")
    if options.sequence_parallel and config.block_size % tp:
        problems.append(f"block_size ({config.block_size}) is not divisible by tensor_parallel_size ({tp}), which"
                        " sequence_parallel=True needs to split positions")
    if problems:
        raise LayoutError("GPTConfig does not fit the layout: " + "; ".join(problems) + ".")
