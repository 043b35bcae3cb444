"""Policy for the reference GPT (``lightning_3d.models.GPT``)."""

from __future__ import annotations

from torch import nn

from lightning_3d.policies.base import Plan, Policy, PolicyError, find_submodule, join_fqn
from lightning_3d.policies.registry import register_policy


@register_policy("gpt")
class GPTPolicy(Policy):
    model_classes = ("lightning_3d.models.gpt.GPT",)

    def plan(self, root: nn.Module) -> Plan:
        prefix = find_submodule(root, self.model_classes)
        if prefix is None:
            raise PolicyError(
                f"policy='gpt' found no lightning_3d.models.GPT inside {type(root).__name__}."
                " Use policy='auto' for other models."
            )
        gpt = root.get_submodule(prefix)
        return Plan(blocks=[join_fqn(prefix, f"blocks.{i}") for i in range(len(gpt.blocks))])
