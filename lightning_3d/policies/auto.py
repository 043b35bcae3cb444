"""The "auto" policy: a registered policy when a known model class is inside, else one found by structure.

For an unknown model, inside each repeated block (the longest list of same-class layers):

* **attention** -- a module with separate query/key/value/output ``nn.Linear`` children, by their usual names
  (``q_proj/k_proj/v_proj/o_proj``, ``q/k/v/o``, ``query/key/value/out``, ``wq/wk/wv/wo``, ``out_proj``):
  q, k, v column-wise (heads split over tp), output row-wise. Its integer head-count and width attributes
  (``num_heads``, ``n_head``, ``num_attention_heads``, ``num_key_value_heads``, ``n_kv_head``, ``embed_dim``,
  ``hidden_size``) are divided by tp, since such modules often reshape by them.
* **MLP** -- a module whose ``nn.Linear`` children are widening ones (``C -> H``: up, gate) and exactly one
  narrowing one (``H -> C``): the widening ones column-wise, the narrowing one row-wise.

Everything else -- embeddings, the output head, norms, a fused qkv projection -- stays replicated, and one
warning names the weight-holding modules left that way. Sequence parallelism needs a model-specific policy.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from lightning_3d.policies.base import Plan, PlanOptions, Policy, PolicyError, find_submodule, join_fqn
from lightning_3d.policies.registry import register_policy, registered_policies

log = logging.getLogger(__name__)

ATTENTION_NAMES = [
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "k_proj", "v_proj", "out_proj"),
    ("q", "k", "v", "o"),
    ("query", "key", "value", "out"),
    ("wq", "wk", "wv", "wo"),
]
HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_head",
                   "embed_dim", "hidden_size")


@register_policy("auto")
class AutoPolicy(Policy):
    """Delegates to the registered policy whose ``model_classes`` the model contains; otherwise plans by
    structure (see the module docstring)."""

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        policy = self.known_policy(root)
        if policy is not None:
            log.info("policy='auto' uses policy=%r for %s", policy.name, type(root).__name__)
            return policy.plan(root, options)
        blocks = repeated_blocks(root)
        if not blocks:
            log.warning(
                "policy='auto' found no repeated blocks in %s. Register a policy"
                " (lightning_3d.policies.register_policy) to name them.", type(root).__name__,
            )
        if options.tp == 1:
            return Plan(blocks=blocks)
        if options.sequence_parallel:
            raise PolicyError(
                f"policy='auto' cannot apply sequence parallelism to {type(root).__name__}: it needs to know the"
                " model's norms and residual stream. Register a policy for the model, or sequence_parallel=False."
            )
        return structural_tp_plan(root, blocks, options.tp)

    @staticmethod
    def known_policy(root: nn.Module) -> Policy | None:
        for cls in registered_policies().values():
            if cls.model_classes and find_submodule(root, cls.model_classes) is not None:
                return cls()
        return None


def repeated_blocks(root: nn.Module) -> list[str]:
    """FQNs of the children of the longest ``ModuleList``/``ModuleDict``/``Sequential`` whose children share
    one class and hold parameters (transformer layers, in every model we know)."""
    best: list[str] = []
    for fqn, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        same_class = len({type(child) for _, child in children}) == 1
        has_params = all(any(True for _ in child.parameters()) for _, child in children)
        if same_class and has_params and len(children) > len(best):
            best = [join_fqn(fqn, name) for name, _ in children]
    return best


def structural_tp_plan(root: nn.Module, blocks: list[str], tp: int) -> Plan:
    tp_plan: dict[str, ParallelStyle] = {}
    fixes: dict[str, dict[str, int]] = {}
    for block in blocks:
        for name, module in root.get_submodule(block).named_modules():
            fqn = join_fqn(block, name)
            attention = _attention_styles(module)
            styles = attention or _mlp_styles(module)
            if styles is None:
                continue
            # The region's input stays a replicated DTensor inside it: one gradient reduction for all of
            # its column-wise layers, at the boundary.
            tp_plan[fqn] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
            tp_plan.update({join_fqn(fqn, child): style for child, style in styles.items()})
            if attention:
                fixes[fqn] = _per_rank_sizes(module, tp)
    _warn_replicated(root, tp_plan)
    return Plan(blocks=blocks, tp_plan=tp_plan, attribute_fixes=fixes)


def _per_rank_sizes(attention: nn.Module, tp: int) -> dict[str, int]:
    sizes = {a: getattr(attention, a) for a in HEAD_ATTRIBUTES if type(getattr(attention, a, None)) is int}
    uneven = {a: v for a, v in sizes.items() if v % tp}
    if uneven:
        raise PolicyError(f"{type(attention).__name__}: {uneven} are not divisible by tensor_parallel_size ({tp});"
                          " heads are split whole across tp ranks.")
    return {a: v // tp for a, v in sizes.items()}


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}


def _attention_styles(module: nn.Module) -> dict[str, ParallelStyle] | None:
    linears = _linear_children(module)
    for q, k, v, o in ATTENTION_NAMES:
        if all(name in linears for name in (q, k, v, o)):
            return {q: ColwiseParallel(), k: ColwiseParallel(), v: ColwiseParallel(), o: RowwiseParallel()}
    return None


def _mlp_styles(module: nn.Module) -> dict[str, ParallelStyle] | None:
    linears = _linear_children(module)
    if len(linears) < 2 or len(linears) != sum(1 for _ in module.children()) - _activations(module):
        return None
    narrowing = [n for n, l in linears.items() if l.in_features > l.out_features]
    widening = [n for n, l in linears.items() if l.in_features < l.out_features]
    if len(narrowing) != 1 or len(widening) + 1 != len(linears):
        return None
    hidden = linears[narrowing[0]].in_features
    if any(linears[n].out_features != hidden for n in widening):
        return None
    return {**{n: ColwiseParallel() for n in widening}, narrowing[0]: RowwiseParallel()}


def _activations(module: nn.Module) -> int:
    """Children without parameters (activations, dropout) that may sit between an MLP's Linears."""
    return sum(1 for child in module.children() if not any(True for _ in child.parameters()))


def _warn_replicated(root: nn.Module, tp_plan: dict[str, ParallelStyle]) -> None:
    left = [fqn for fqn, module in root.named_modules()
            if isinstance(module, (nn.Linear, nn.Embedding)) and fqn not in tp_plan]
    if left:
        log.warning("policy='auto' keeps these layers replicated on every tp rank: %s", ", ".join(left))
