"""When a model's forward uses each of its modules, relative to its blocks: recorded on a meta-device copy.

``policy="auto"`` cuts a model into pipeline stages along its blocks; the first stage keeps what runs before
them (embeddings), the last stage what runs after them (final norm, head). The order in which modules are
registered does not say which: OPT registers its final norm before its layers and calls it after them.
:func:`forward_uses` runs the forward of the model once on a meta copy (no memory, no values, no random
numbers) on a few token ids and numbers, in order, every use of each group of modules: a call of one of its
modules, or an op that reads one of its parameters outside such a call (``F.linear(x, self.wte.weight)``; a
parameter tied to another group's counts for the group whose module is running).

The token ids and what the forward derives from them carry host values (``policies.meta_values``), so mask
code that reads them runs. A forward that stops on meta all the same (one that reads a value computed from
weights) still tells what it used before it stopped; a group it never reached has no entry, and the caller
decides without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_3d.policies.block_inputs import required_positionals
from lightning_3d.policies.block_trace import meta_copy
from lightning_3d.policies.meta_values import MetaValues


@dataclass(frozen=True)
class Span:
    """The first and the last use of a group, as positions in the forward's sequence of uses."""

    first: int
    last: int


def forward_uses(model: nn.Module, groups: dict[str, list[str]], tokens: int = 4) -> dict[str, Span]:
    """For each group of ``groups`` (a name -> FQNs of submodules of ``model``) that the forward of ``model``
    uses when called on ``tokens`` token ids (``model(ids)``, else with masks of ones for the other required
    positional arguments), the span of its uses. ``model`` is not run: a copy of it on the meta device is."""
    twin = meta_copy(model)
    recorder = _Recorder(twin, groups)
    masks = required_positionals(twin) - 1
    try:
        for with_masks in ([False, True] if masks else [False]):
            recorder.reset()
            try:
                # Inputs made on meta inside MetaValues carry host values: mask code that reads them runs.
                with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("meta"), MetaValues():
                    ids = torch.zeros(1, tokens, dtype=torch.long)
                    args = [ids, *[torch.ones_like(ids)] * masks] if with_masks else [ids]
                    with recorder:
                        twin(*args)
            except Exception:  # noqa: BLE001 -- what ran before the forward stopped is recorded all the same
                pass
            if recorder.spans:
                break
    finally:
        recorder.remove()
    return recorder.spans


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module, groups: dict[str, list[str]]) -> None:
        super().__init__()
        self.group_of: dict[int, str] = {}  # module -> its group
        self.owners: dict[int, set[str]] = {}  # parameter -> the groups that hold it
        for group, fqns in groups.items():
            for fqn in fqns:
                for module in model.get_submodule(fqn).modules():
                    self.group_of[id(module)] = group
                    for param in module.parameters(recurse=False):
                        self.owners.setdefault(id(param), set()).add(group)
        self.handles = [hook for module in model.modules() if id(module) in self.group_of for hook in (
            module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._leave))]
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.running: list[str] = []  # the groups whose modules are running, innermost last
        self.spans: dict[str, Span] = {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _use(self, group: str) -> None:
        self.count += 1
        span = self.spans.get(group)
        self.spans[group] = Span(span.first if span else self.count, self.count)

    def _enter(self, module: nn.Module, args: Any) -> None:
        group = self.group_of[id(module)]
        self._use(group)
        self.running.append(group)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.running:
            self.running.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for x in tree_flatten((args, kwargs or {}))[0]:
            owners = self.owners.get(id(x)) if isinstance(x, nn.Parameter) else None
            if owners and not owners & set(self.running[-1:]):
                for group in sorted(owners):
                    self._use(group)
        return func(*args, **(kwargs or {}))

