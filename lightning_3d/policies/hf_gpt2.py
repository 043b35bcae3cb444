"""Policy for Hugging Face ``GPT2LMHeadModel``: Megatron-style tensor and sequence parallel, pipeline stages.

GPT-2 is the reference GPT (``policies/gpt.py``) with three twists, each handled here:

* **Conv1D.** Its projections are ``transformers.pytorch_utils.Conv1D``: ``x @ weight + bias`` with ``weight``
  stored ``(in, out)``, transposed relative to ``nn.Linear``. Column-wise therefore splits weight dim 1 and
  the bias; row-wise splits weight dim 0 and keeps the bias whole, added once after the reduction.
  ``policies.projections``' :class:`ColumnSplit` / :class:`RowSplit` place it so.
* **Fused q|k|v.** ``c_attn`` maps C -> 3C, columns ``[q | k | v]``. A plain split of dim 1 would give rank 0
  all of q; each rank needs q, k and v of its own heads. ``_StridedShard(1, split_factor=3)`` is exactly that
  (rank r holds ``[q_r | k_r | v_r]``), DTensor computes with it, and HF's ``split(split_size)`` then cuts the
  local output into this rank's q, k, v once ``split_size`` is the per-rank width. The parameter keeps its
  single-device name, shape and column order, so checkpoints stay in the Hugging Face layout; a rank's piece
  is three boxes, which ``lightning_3d.checkpoint.boxes`` tells DCP and ``init_from`` about.
* **Tied embeddings.** ``lm_head.weight`` is ``transformer.wte.weight``: both are split over the vocabulary
  (same placements), and the pair goes into ``Plan.tied_parameters`` for the strategy to re-tie them, or, on
  different pipeline stages, to sum their gradients.

Sequence parallel: HF's ``GPT2Model.forward`` builds position ids and the causal mask from the embedding's
output length, so that output stays whole (the token embedding all-reduces instead of reduce-scattering) and
is split along the sequence after the embedding dropout, locally. Dropout on tp-sharded data (attention
probabilities of this rank's heads; with SP also the residual dropouts on sequence shards) draws from the
tp-rank stream. Without SP the residual dropout inside ``GPT2Attention`` sees replicated data, so attention
stays on the default stream: attention-probability masks then repeat across the tp ranks' head groups
(statistically harmless; use sequence_parallel=True for independent masks).
"""

from __future__ import annotations

from functools import partial

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
from lightning_3d.policies.projections import ColumnSplit, RowSplit
from lightning_3d.policies.registry import register_policy

GPT2_CLASS = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"


@register_policy("gpt2")
class GPT2Policy(Policy):
    """Tensor, sequence and pipeline parallel plan for ``transformers.GPT2LMHeadModel``.

    Example::

        ThreeDStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, policy="gpt2")
    """

    model_classes = (GPT2_CLASS,)

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        prefix = find_submodule(root, self.model_classes)
        if prefix is None:
            raise PolicyError(
                f"policy='gpt2' found no {GPT2_CLASS} inside {type(root).__name__}: it expects a GPT2LMHeadModel"
                " with transformer.wte, transformer.wpe, transformer.h.<i> (GPT2Block: ln_1, attn.c_attn, attn.c_proj,"
                " ln_2, mlp.c_fc, mlp.c_proj), transformer.ln_f and lm_head. Use policy='auto' for other models."
            )
        gpt2 = root.get_submodule(prefix)
        config = gpt2.config
        if config.add_cross_attention:
            raise PolicyError("policy='gpt2' does not split cross-attention (config.add_cross_attention=True).")
        fqn = partial(join_fqn, prefix)
        plan = Plan(
            blocks=[fqn(f"transformer.h.{i}") for i in range(len(gpt2.transformer.h))],
            pipeline_root=prefix,
            before=[fqn(f"transformer.{n}") for n in ("wte", "wpe", "drop")],
            after=[fqn("transformer.ln_f"), fqn("lm_head")],
            tied_parameters=_tied(gpt2, fqn),
            forward_as_written=True,  # each stage runs the model's own forward (pipeline.as_written)
            init_module=gpt2._init_weights,  # modules without reset_parameters, on the meta device
        )
        if options.tp == 1:
            return plan
        _check_sizes(config, options)
        plan.tp_plan = {fqn(name): style for name, style in gpt2_tp_plan(options).items()}
        per_rank = {"split_size": config.n_embd // options.tp, "embed_dim": config.n_embd // options.tp,
                    "num_heads": config.n_head // options.tp}
        plan.attribute_fixes = {fqn(f"transformer.h.{i}.attn"): dict(per_rank) for i in range(config.n_layer)}
        if options.sequence_parallel and (config.attn_pdrop > 0 or config.resid_pdrop > 0):
            plan.sharded_rng_regions = [fqn("transformer.h.*.attn"), fqn("transformer.h.*.mlp.dropout")]
        return plan


def gpt2_tp_plan(options: PlanOptions) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a GPT2LMHeadModel, relative to it (see the module docstring)."""
    sp = options.sequence_parallel
    between = Shard(1) if sp else Replicate()  # activations between regions: whole, or split along the sequence
    head_output = dict(output_layouts=Shard(-1), use_local_output=False) if options.vocab_parallel_loss else (
        dict(output_layouts=Replicate())
    )
    plan: dict[str, ParallelStyle] = {
        # Whole output even with SP: GPT2Model derives positions and the causal mask from its length.
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=between, **head_output),
    }
    # A replicated region input stays a DTensor inside it: q|k|v (c_fc) share one gradient reduction.
    region_input = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
    plan.update({
        "transformer.h.*.attn": region_input,
        "transformer.h.*.attn.c_attn": ColumnSplit(parts=3),
        "transformer.h.*.attn.c_proj": RowSplit(output_layouts=between),
        "transformer.h.*.mlp": region_input,
        "transformer.h.*.mlp.c_fc": ColumnSplit(),
        "transformer.h.*.mlp.c_proj": RowSplit(output_layouts=between),
    })
    if sp:
        for norm in ("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"):
            plan[norm] = SequenceParallel()
        # Embeddings and their dropout run on whole (replicated) data; the blocks get sequence shards, cut
        # locally without communication.
        plan["transformer.drop"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    return plan


def _tied(gpt2: nn.Module, fqn) -> list[tuple[str, str]]:
    if gpt2.lm_head.weight is gpt2.transformer.wte.weight:
        return [(fqn("transformer.wte.weight"), fqn("lm_head.weight"))]
    return []


def _check_sizes(config, options: PlanOptions) -> None:
    tp = options.tp
    problems = []
    if config.n_head % tp:
        allowed = [t for t in range(1, config.n_head + 1) if config.n_head % t == 0]
        problems.append(f"n_head ({config.n_head}) is not divisible by tensor_parallel_size ({tp}): heads are split"
                        f" whole across tp ranks; tensor_parallel_size may be {allowed}")
    inner = config.n_inner or 4 * config.n_embd
    if inner % tp:
        problems.append(f"the MLP width ({inner}) is not divisible by tensor_parallel_size ({tp})")
    if config.vocab_size % tp:
        padded = -(-config.vocab_size // tp) * tp
        problems.append(f"vocab_size ({config.vocab_size}) is not divisible by tensor_parallel_size ({tp}): set"
                        f" vocab_size={padded} (the extra ids are never produced by the data)")
    if problems:
        raise LayoutError("GPT2Config does not fit the layout: " + "; ".join(problems) + ".")
