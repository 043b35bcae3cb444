"""A policy reads a model and says, as plain data, how to parallelize it; appliers do the work."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


class PolicyError(ValueError):
    """A policy that cannot be found or cannot handle the model; the message says what to change."""


@dataclass(kw_only=True)
class Plan:
    """How to parallelize one model. Every name is a fully qualified module name (FQN) relative to the
    LightningModule, i.e. the names ``named_modules()`` of the single-device model gives.

    Example::

        Plan(blocks=["model.blocks.0", "model.blocks.1"])
    """

    blocks: list[str] = field(default_factory=list)
    """The repeated blocks (transformer layers) in execution order: the units pipeline stages are cut from
    and activation checkpointing wraps."""


class Policy:
    """Base class: subclass, implement :meth:`plan`, and register it with :func:`register_policy`.

    ``model_classes`` names (``module.QualName``) the model classes the policy was written for; the "auto"
    policy picks a registered policy by them. A policy never talks to a process group.

    Example::

        @register_policy("my_net")
        class MyNetPolicy(Policy):
            model_classes = ("my_pkg.models.MyNet",)

            def plan(self, root):
                prefix = find_submodule(root, self.model_classes)
                return Plan(blocks=[f"{prefix}.layers.{i}" for i in range(len(root.get_submodule(prefix).layers))])
    """

    name: str = ""
    model_classes: tuple[str, ...] = ()

    def plan(self, root: nn.Module) -> Plan:
        raise NotImplementedError(f"{type(self).__name__} must implement plan(root) -> Plan")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def class_path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def find_submodule(root: nn.Module, classes: tuple[str, ...]) -> str | None:
    """The FQN of the first submodule of ``root`` (itself included, as "") whose class path is in ``classes``."""
    for fqn, module in root.named_modules():
        if class_path(module) in classes:
            return fqn
    return None


def join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
