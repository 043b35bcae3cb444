"""Policy for Hugging Face ``LlamaForCausalLM`` and models of the same layout (Mistral, Qwen2).

Tensor parallel, Megatron-style, as the reference GPT's policy (``policies/gpt.py``): per decoder layer the
attention input is gathered once (q, k, v column-wise: heads split over tp; o row-wise), the same for the
MLP (gate and up column-wise, down row-wise); the token embedding is vocabulary-parallel and ``lm_head``
column-wise over the vocabulary, its logits left sharded for the vocabulary-parallel loss. With sequence
parallelism the RMSNorms run on sequence shards; the embedding's output stays whole (the model's forward
derives positions and the causal mask from its length) and is cut along the sequence entering layer 0. Grouped-query attention: the kv heads are split when tp
divides them, replicated when they divide tp (``lightning_3d.policies.kv_heads``); other tp sizes fail,
listing the ones that work. The attention modules reshape with ``-1`` heads, so only the query-to-kv group
size (``num_key_value_groups``) changes per rank when kv heads are replicated.

Pipeline: the embedding on the first stage, decoder layers split, final norm and ``lm_head`` on the last;
every stage runs ``LlamaForCausalLM.forward`` as written (``lightning_3d.pipeline.as_written``), so the
rotary embedding (no parameters, on every stage) and the model's own code rebuild positions and masks from
the model's inputs, which travel with the hidden states.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_3d.errors import LayoutError
from lightning_3d.common import join_fqn
from lightning_3d.policies.base import Plan, PlanOptions, Policy, PolicyError, class_path, find_submodule
from lightning_3d.policies.kv_heads import ReplicatedKVHeads, allowed_tp_sizes, kv_head_rule
from lightning_3d.policies.registry import register_policy

EXPECTED = "model.embed_tokens, model.layers[i].self_attn.{q,k,v,o}_proj, model.layers[i].mlp.{gate,up,down}_proj, model.norm, lm_head"


@register_policy("llama")
class LlamaPolicy(Policy):
    model_classes = (
        "transformers.models.llama.modeling_llama.LlamaForCausalLM",
        "transformers.models.mistral.modeling_mistral.MistralForCausalLM",
        "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM",
    )

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        prefix = find_submodule(root, self.model_classes)
        if prefix is None:
            found = class_path(root.model) if isinstance(getattr(root, "model", None), nn.Module) else class_path(root)
            raise PolicyError(
                f"policy='llama' found no LlamaForCausalLM (nor Mistral/Qwen2ForCausalLM) inside {type(root).__name__}"
                f" (its model is {found}). It expects {EXPECTED}. Use policy='auto', or register a policy for it."
            )
        lm = root.get_submodule(prefix)
        config = lm.config
        layers = [join_fqn(prefix, f"model.layers.{i}") for i in range(len(lm.model.layers))]
        plan = Plan(
            blocks=layers,
            pipeline_root=prefix,
            before=[join_fqn(prefix, "model.embed_tokens")],
            after=[join_fqn(prefix, "model.norm"), join_fqn(prefix, "lm_head")],
            forward_as_written=True,  # each stage runs the model's own forward (pipeline.as_written)
            init_module=lm._init_weights,  # modules without reset_parameters, on the meta device
        )
        if lm.lm_head.weight is lm.model.embed_tokens.weight:
            plan.tied_parameters = [(join_fqn(prefix, "model.embed_tokens.weight"), join_fqn(prefix, "lm_head.weight"))]
        if options.tp == 1:
            return plan
        rule = _check_sizes(config, options)
        plan.tp_plan = {join_fqn(prefix, name): style for name, style in llama_tp_plan(config, options, rule).items()}
        if rule == "replicate":
            groups = config.num_attention_heads // options.tp  # this rank's query heads share its one kv head
            plan.attribute_fixes = {join_fqn(layer, "self_attn"): {"num_key_value_groups": groups} for layer in layers}
        if getattr(config, "attention_dropout", 0.0) > 0:
            plan.sharded_rng_regions = [join_fqn(prefix, "model.layers.*.self_attn")]
        return plan


def llama_tp_plan(config: Any, options: PlanOptions, rule: str) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan, relative to the ``...ForCausalLM`` module."""
    between = Shard(1) if options.sequence_parallel else Replicate()
    head_output = dict(output_layouts=Shard(-1), use_local_output=False) if options.vocab_parallel_loss else (
        dict(output_layouts=Replicate()))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = ColwiseParallel() if rule == "split" else ReplicatedKVHeads(kv_heads=config.num_key_value_heads,
                                                                      head_dim=head_dim)
    plan: dict[str, ParallelStyle] = {
        # Whole output even with SP: LlamaModel.forward derives positions and the causal mask from its length.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=between, **head_output),
        # The decoder layer passes the attention its input by keyword.
        "model.layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": between}, desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": kv,
        "model.layers.*.self_attn.v_proj": kv,
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    if options.sequence_parallel:
        for norm in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"):
            plan[norm] = SequenceParallel()
        # The residual stream enters the first layer split along the sequence: a local cut, no communication.
        plan["model.layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                    use_local_output=True)
    return plan


def _check_sizes(config: Any, options: PlanOptions) -> str:
    tp, heads, kv_heads = options.tp, config.num_attention_heads, config.num_key_value_heads
    problems = []
    rule = kv_head_rule(heads, kv_heads, tp)
    if rule is None:
        problems.append(
            f"{heads} attention heads and {kv_heads} key/value heads cannot be split over tensor_parallel_size={tp}"
            f" (query heads are split whole; kv heads are split when tp divides them, replicated when they divide"
            f" tp); allowed tensor_parallel_size: {allowed_tp_sizes(heads, kv_heads)}")
    if config.vocab_size % tp:
        padded = -(-config.vocab_size // tp) * tp
        problems.append(f"vocab_size ({config.vocab_size}) is not divisible by tensor_parallel_size ({tp}): pad the"
                        f" vocabulary to {padded} (resize_token_embeddings)")
    if problems:
        raise LayoutError(f"{type(config).__name__} does not fit the layout: " + "; ".join(problems) + ".")
    return rule

