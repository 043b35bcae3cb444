"""Tensor parallel over the "tp" mesh dimension: a policy's plan, checked, then applied by PyTorch."""

from __future__ import annotations

from collections import defaultdict
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_3d.errors import LayoutError
from lightning_3d.parallel.sharded_logits import mark_logits_of
from lightning_3d.pipeline.split import PLACEHOLDERS
from lightning_3d.policies.base import Plan
from lightning_3d.policies.kv_heads import ReplicatedKVHeads


def apply_tensor_parallel(root: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> None:
    """Swap in the plan's parallel layers (DTensor parameters on ``tp_mesh``) and apply its attribute fixes,
    for the modules ``root`` holds (a pipeline stage holds some; check the plan on the whole model first
    with :func:`check_tp_plan`).

    Runs on the meta device as well: parameters become DTensors whose local shards are allocated and
    initialized later (``lightning_3d.parallel.weight_init``)."""
    # Patterns expanded here to the modules this rank holds: parallelize_module would also expand a "*" over
    # the placeholders of blocks other pipeline stages hold, and warn for each.
    present = {fqn: style for pattern, style in plan.tp_plan.items() for fqn in match_modules(root, pattern)
               if not isinstance(root.get_submodule(fqn), PLACEHOLDERS)}
    parallelize_module(root, tp_mesh, present)
    for fqn, style in present.items():
        if _leaves_output_sharded_on_last_dim(style):  # the output head, under a vocabulary-parallel loss
            mark_logits_of(root.get_submodule(fqn))
    held = {fqn for fqn, _ in root.named_modules()}
    for fqn, attributes in plan.attribute_fixes.items():
        if fqn in held:
            for name, value in attributes.items():
                setattr(root.get_submodule(fqn), name, value)


def _leaves_output_sharded_on_last_dim(style: ParallelStyle) -> bool:
    if not isinstance(style, ColwiseParallel) or style.use_local_output:
        return False
    return [(p.is_shard(), getattr(p, "dim", None)) for p in style.output_layouts] == [(True, -1)]


def match_modules(root: nn.Module, pattern: str) -> list[str]:
    """FQNs of the modules a plan pattern names; ``*`` matches any one name, as in ``parallelize_module``."""
    atoms = pattern.split(".")
    return [
        fqn for fqn, _ in root.named_modules()
        if fqn and len(fqn.split(".")) == len(atoms)
        and all(fnmatchcase(name, atom) for name, atom in zip(fqn.split("."), atoms))
    ]


def check_tp_plan(root: nn.Module, tp_plan: dict[str, ParallelStyle], tp: int) -> None:
    """Every pattern names at least one module, and every split divides the size it splits; else one error
    listing all problems (raised identically on every rank, before any parameter is sharded)."""
    problems = []
    for pattern, style in tp_plan.items():
        fqns = match_modules(root, pattern)
        if not fqns:
            problems.append(f"pattern {pattern!r} ({type(style).__name__}) matches no module")
        for fqn in fqns:
            problem = _split_problem(root.get_submodule(fqn), style, tp)
            if problem:
                problems.append(f"{fqn}: {problem}")
    if problems:
        raise LayoutError(
            f"The tensor-parallel plan does not fit the model at tensor_parallel_size={tp}:\n  - "
            + "\n  - ".join(problems)
            + "\nChange the model sizes, tensor_parallel_size, or the policy."
        )


def _split_problem(module: nn.Module, style: ParallelStyle, tp: int) -> str | None:
    """What a column-/row-wise split of ``module`` over ``tp`` ranks cannot do, or None."""
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or isinstance(style, ReplicatedKVHeads):
        return None
    column = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        name, size = ("out_features", module.out_features) if column else ("in_features", module.in_features)
    elif isinstance(module, nn.Embedding):
        name, size = ("embedding_dim", module.embedding_dim) if column else ("num_embeddings", module.num_embeddings)
    elif type(module).__name__ == "Conv1D":  # transformers' Conv1D (GPT-2): weight (nx, nf), in x out
        name, size = ("nf", module.nf) if column else ("nx", module.nx)
    else:
        return f"{type(style).__name__} applies to nn.Linear or nn.Embedding, not {type(module).__name__}"
    if size % tp:
        return f"{type(style).__name__} splits {name}={size} over {tp} ranks, which does not divide it"
    return None


def reduce_partial_grads(module: nn.Module) -> None:
    """Finish the gradients that backward left as pending sums (``Partial``) across tp ranks, in one
    collective per (mesh, placements) group.

    Replicated parameters used on sharded activations -- the norms under sequence parallelism -- get a
    partial gradient on each tp rank. Left alone, every optimizer op that reads such a gradient would
    all-reduce it again; Megatron-LM sums them once per step, coalesced, and so does this."""
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for param in module.parameters():
        grad = param.grad
        if not isinstance(grad, DTensor):
            continue
        split = isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)
        if split and grad.placements != param.placements:
            # A split weight with a whole gradient (a vocabulary-parallel embedding's, from DTensor's embedding
            # backward: pending, or already summed under the pipeline): cut it to the weight's split, rather
            # than keep it whole -- twice the weight's bytes, redistributed again by every optimizer op.
            param.grad = _own_storage(grad.redistribute(placements=param.placements))
            continue
        if any(p.is_partial() for p in grad.placements):
            groups[(grad.device_mesh, grad.placements)].append(param)
    for (mesh, placements), params in groups.items():
        locals_ = [p.grad.to_local() for p in params]
        flat = DTensor.from_local(torch.cat([t.reshape(-1) for t in locals_]), mesh, placements, run_check=False)
        done = [Replicate() if p.is_partial() else p for p in placements]
        summed = flat.redistribute(placements=done).to_local()
        for param, local, chunk in zip(params, locals_, summed.split([t.numel() for t in locals_])):
            param.grad = DTensor.from_local(chunk.view_as(local), mesh, done, run_check=False)


def _own_storage(grad: DTensor) -> DTensor:
    """``grad`` with a local tensor of its own: a redistribute to a split can hand back this rank's chunk as a
    view of the whole tensor (from Replicate; over gloo, from Partial too: an all-reduce, then the chunk), and
    the view would keep the whole one alive."""
    piece = grad.to_local()
    if piece.untyped_storage().nbytes() == piece.numel() * piece.element_size():
        return grad
    return DTensor.from_local(piece.clone(), grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
                              stride=grad.stride())
