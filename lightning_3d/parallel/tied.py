"""Tied parameters (an input embedding shared with the output head) across tensor and pipeline parallelism.

* **On one rank** (no pipeline, or both ends on one stage): tensor parallelism replaces each module's
  parameter by its own DTensor, which unties them; :func:`retie` makes the second name point at the first
  one's parameter again (their placements agree: both split over the vocabulary).
* **Across stages**: the embedding lives on the first stage and the head on the last, each holding a copy.
  The copies start equal (one initial state, broadcast) and stay equal because every step their gradients
  are summed over the two ranks of an "embedding group" -- the ranks at pipeline positions 0 and pp - 1
  with the same (dp, tp) coordinates -- before the optimizer sees them (Megatron-LM's embedding group).
  Both ranks then apply the same update to the same values.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_3d.common import local
from lightning_3d.parallel.clip import mark_stage_copies
from lightning_3d.parallel.dims import ParallelDims, RankCoords
from lightning_3d.parallel.group_cache import once_per_world
from lightning_3d.policies.base import PolicyError


def retie(module: nn.Module, pairs: list[tuple[str, str]]) -> list[str]:
    """Re-tie each pair held whole by ``module``; return the FQNs of the pairs it holds one end of (the
    copies whose gradients :class:`TiedGradients` sums across stages)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    one_end = []
    for first, second in pairs:
        if first in params and second in params:
            if params[first] is not params[second]:
                _set_parameter(module, second, params[first])
        elif first in params or second in params:
            one_end.append(first if first in params else second)
    return one_end


def _set_parameter(module: nn.Module, fqn: str, param: nn.Parameter) -> None:
    owner_name, _, name = fqn.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    old = getattr(owner, name)
    if old.shape != param.shape or type(old) is not type(param) or (
            isinstance(old, DTensor) and old.placements != param.placements):
        raise PolicyError(f"the tied parameters {fqn} and its partner are placed differently after tensor"
                          " parallelism; the policy must split both the same way (over the vocabulary)")
    setattr(owner, name, param)


def embedding_group(dims: ParallelDims, coords: RankCoords) -> dist.ProcessGroup:
    """This rank's pair of (first stage, last stage) ranks at its (dp, cp, tp). Collective: every rank of the
    world creates every pair, in the same order, as ``new_group`` requires. Made once per process and layout
    (``parallel/group_cache.py``)."""
    per_stage = dims.world_size // dims.pp  # a pipeline per rank of the first stage (ranks 0 .. per_stage - 1)

    def make() -> list[dist.ProcessGroup]:
        return [dist.new_group([dims.group_ranks("pp", first)[i] for i in (0, -1)]) for first in range(per_stage)]

    pairs = once_per_world(("embedding pairs", dims.pp, dims.dp, dims.cp, dims.tp), make)
    return pairs[dims.rank(coords) % per_stage]


class TiedGradients:
    """Sums the gradients of this rank's copies of tied parameters over the embedding group. Built once data
    parallelism has wrapped the stages (FSDP2 replaces parameters); marks each copy as one of two, so the
    global norm and the parameter count take it once."""

    def __init__(self, module: nn.Module, fqns: list[str], group: dist.ProcessGroup | None) -> None:
        params = dict(module.named_parameters(remove_duplicate=False))
        self.params = [params[fqn] for fqn in fqns]
        self.group = group
        for param in self.params:
            mark_stage_copies(param, 2)

    def __call__(self) -> None:
        for param in self.params:
            if param.grad is None:
                raise RuntimeError("a tied parameter got no gradient this step; its partner on the other end"
                                   " of the pipeline would wait for it")
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # An embedding's gradient can come back from backward replicated over tp, the head's split over
                # the vocabulary like its weight: both ends sum the same pieces.
                param.grad = param.grad.redistribute(placements=param.placements)
            dist.all_reduce(local(param.grad), group=self.group)
