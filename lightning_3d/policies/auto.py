"""The "auto" policy: a registered policy when a known model class is inside, else one found by structure.

For an unknown model the repeated blocks the pipeline cuts are the longest list of same-class layers
(:func:`repeated_blocks`); at tp > 1 the blocks of every list of them (:func:`block_lists`: a vision
encoder's and a text decoder's, two stacks run in turns) are split from what one block of each kind
computes, traced on the meta device (:mod:`~lightning_3d.policies.auto_tp`): attention and MLP regions, fused q|k|v and gate|up, sibling modules,
``Conv1D``, the head counts they reshape by. Embeddings and the output head stay whole on every tp rank. A
block auto cannot split is refused unless ``allow_replicated=True``; the pipeline part of the plan is
:mod:`~lightning_3d.policies.auto_pipeline`'s.
"""

from __future__ import annotations

import logging

from torch import nn

from lightning_3d.common import join_fqn
from lightning_3d.policies.auto_tp import structural_tp_plan
from lightning_3d.policies.base import Plan, PlanOptions, Policy, PolicyError, find_submodule
from lightning_3d.policies.block_trace import is_projection
from lightning_3d.policies.experts import routed_experts
from lightning_3d.policies.registry import register_policy, registered_policies

log = logging.getLogger(__name__)


@register_policy("auto")
class AutoPolicy(Policy):
    """Delegates to the registered policy whose ``model_classes`` the model contains; otherwise plans by
    structure (see the module docstring)."""

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        policy = self.known_policy(root)
        if policy is not None:
            log.info("policy='auto' uses policy=%r for %s", policy.name, type(root).__name__)
            return policy.plan(root, options)
        lists = block_lists(root)
        blocks = lists[0] if lists else []
        if not blocks:
            log.warning(
                "policy='auto' found no repeated blocks in %s. Register a policy"
                " (lightning_3d.policies.register_policy) to name them.", type(root).__name__,
            )
        if options.tp == 1:
            return Plan(blocks=blocks, experts=routed_experts(root, blocks))
        if not blocks:  # tensor parallelism would split nothing: never a silent no-op
            raise PolicyError(
                f"policy='auto' found no repeated blocks in {type(root).__name__} (a list of two or more layers of"
                f" one class), so at tensor_parallel_size={options.tp} it would split nothing and every rank would"
                " hold and compute the whole model. Register a policy that names the blocks and their tp plan"
                " (lightning_3d.policies.register_policy), or train with tensor_parallel_size=1."
            )
        plan = structural_tp_plan(root, lists, options)
        plan.experts = routed_experts(root, blocks)
        return plan

    @staticmethod
    def known_policy(root: nn.Module) -> Policy | None:
        for cls in registered_policies().values():
            if cls.model_classes and find_submodule(root, cls.model_classes) is not None:
                return cls()
        return None


def repeated_blocks(root: nn.Module) -> list[str]:
    """FQNs of the blocks the pipeline cuts: the longest list of :func:`block_lists` (the first on a tie)."""
    return next(iter(block_lists(root)), [])


def block_lists(root: nn.Module) -> list[list[str]]:
    """Every list of blocks in ``root``, as their FQNs: the pipeline's (:func:`repeated_blocks`) first, then
    the other lists tensor parallelism splits too, in the order the model registers them.

    A list of blocks is an outermost ``ModuleList``/``ModuleDict``/``Sequential`` of layers: a list inside
    one of those layers (a mixture of experts' MLPs) is part of the layer. Layers are children that share
    one class and hold parameters (transformer layers), or, in a hybrid model's list of layers of several
    classes (attention and linear-attention layers), children that each hold a projection. The pipeline's is
    the longest (the first on a tie). A model may hold more (a vision encoder's and a text decoder's, or two
    stacks its forward runs in turns); of those, the lists whose layers each hold a projection and are not
    one count (not a list of LayerNorms, or of bare projections one per stream)."""
    lists = []
    for fqn, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        same_class = len({type(child) for _, child in children}) == 1
        has_params = all(any(True for _ in child.parameters()) for _, child in children)
        hybrid = not same_class and all(any(is_projection(m) for m in child.modules()) for _, child in children)
        if (same_class and has_params) or hybrid:
            lists.append([join_fqn(fqn, name) for name, _ in children])
    outermost = [found for found in lists
                 if not any(found[0].startswith(child + ".") for other in lists for child in other)]
    if not outermost:
        return []
    longest = max(outermost, key=len)
    return [longest, *[found for found in outermost if found is not longest
                       and all(_holds_projection(root.get_submodule(fqn)) for fqn in found)]]


def _holds_projection(layer: nn.Module) -> bool:
    return not is_projection(layer) and any(is_projection(m) for m in layer.modules())
