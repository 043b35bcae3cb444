"""The pipeline part of the "auto" plan: where the blocks sit, and what runs before and after them.

For a plan that names only its blocks -- what "auto" gives for a model no policy was written for, or a user's
policy for tensor parallelism -- the blocks are the longest list of same-class layers
(``auto.repeated_blocks``). Then, by structure:

* the **pipeline root** is the LightningModule's child that holds them (the model ``training_step`` calls);
* on the path from the root down to the blocks' container, the children with parameters that the forward
  uses **before** the blocks are the first stage's (embeddings), those it uses **after** them the last
  stage's (final norm, output head), in the order one forward on a meta-device copy uses them
  (:mod:`~lightning_3d.policies.call_order`). A child that forward does not reach, or uses both before and
  after the blocks, goes by where it is registered: before the path or after it. Children without
  parameters (dropout, a rotary embedding's buffers) are shared by every stage. Whatever the placement,
  each stage checks at its first call that its output owes nothing to a module it does not hold
  (``pipeline.placeholder_watch``);
* parameters that are one tensor under two names (an input embedding tied to the head) are **tied**;
* each stage runs the model's own forward (``Plan.forward_as_written``, ``lightning_3d.pipeline.as_written``).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from lightning_3d.common import join_fqn, parent_fqn
from lightning_3d.policies.base import Plan
from lightning_3d.policies.call_order import forward_uses


def with_pipeline(root: nn.Module, plan: Plan) -> Plan:
    """``plan`` as it is if it says how to pipeline (a root, or a ``stage_forward``); else, for a plan that
    names only its blocks ("auto" for a model it has no policy for, or a user's policy), the same plan with
    stages that run the model's own forward between those blocks."""
    if plan.pipeline_root is not None or plan.stage_forward is not None or not plan.blocks:
        return plan
    return replace(plan, **pipeline_parts(root, plan.blocks))


def pipeline_parts(root: nn.Module, blocks: list[str]) -> dict:
    """``Plan`` fields for running ``blocks`` of ``root`` (the LightningModule) as pipeline stages; empty
    when the blocks are not inside a child of ``root`` (nothing for ``training_step`` to call)."""
    container = parent_fqn(blocks[0]) if blocks else ""
    path = container.split(".") if container else []
    if len(path) < 2:
        return {}
    candidates: list[tuple[str, bool]] = []  # (FQN, registered before the path)
    for depth in range(1, len(path)):
        parent = ".".join(path[:depth])
        names = [name for name, _ in root.get_submodule(parent).named_children()]
        on_path = names.index(path[depth])
        for index, name in enumerate(names):
            fqn = join_fqn(parent, name)
            if index != on_path and _has_parameters(root.get_submodule(fqn)):
                candidates.append((fqn, index < on_path))
    uses = _uses(root, path[0], [fqn for fqn, _ in candidates], blocks)
    before: list[str] = []
    after: list[str] = []
    for fqn, registered_before in candidates:
        (before if uses.get(fqn, registered_before) else after).append(fqn)
    return dict(pipeline_root=path[0], before=before, after=after, tied_parameters=tied_parameters(root),
                forward_as_written=True)


def _uses(root: nn.Module, pipeline_root: str, candidates: list[str], blocks: list[str]) -> dict[str, bool]:
    """FQN -> whether the forward uses it before the blocks (True) or after them (False), for the candidates
    one forward of the pipeline root on meta uses on one side of the blocks only."""
    def relative(fqn: str) -> str:
        return fqn[len(pipeline_root) + 1:]

    groups = {fqn: [relative(fqn)] for fqn in candidates} | {_BLOCKS: [relative(b) for b in blocks]}
    spans = forward_uses(root.get_submodule(pipeline_root), groups)
    around = spans.get(_BLOCKS)
    if around is None:
        return {}
    return {fqn: span.last < around.first for fqn, span in spans.items()
            if fqn != _BLOCKS and (span.last < around.first or span.first > around.last)}


_BLOCKS = "<blocks>"


def tied_parameters(root: nn.Module) -> list[tuple[str, str]]:
    """Pairs of names that are one parameter, the first name (``named_parameters()``'s) first."""
    names: dict[int, list[str]] = {}
    for fqn, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return [(fqns[0], other) for fqns in names.values() for other in fqns[1:]]


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
