"""Cut the model into pipeline stages along the policy's blocks, keeping every module's single-device name.

Stage ``s`` of ``S = pp * virtual_pipeline_size`` runs on pp rank ``s % pp`` (the looped assignment of
Megatron-LM's and PyTorch's interleaved schedules): with pp=2, v=2, rank 0 runs stages 0 and 2.

On a rank, each stage is its own module (what ``PipelineStage`` calls): a copy of the pipeline root that
keeps only that stage's blocks, plus the embeddings on stage 0 and the head on the last stage (the rest set
to None, deleted from an ``nn.ModuleDict``, or replaced by a ``DroppedBlock`` in an ``nn.ModuleList``). The LightningModule's pipeline root then holds the union of this rank's stages -- the
very same submodule objects -- so ``named_parameters()`` gives this rank's parameters under their
single-device FQNs (optimizer, checkpoints, parity all rely on that).
"""

from __future__ import annotations

import copy
import logging
from functools import partial

from torch import nn

from lightning_3d.errors import LayoutError
from lightning_3d.common import join_fqn, parent_fqn
from lightning_3d.pipeline.as_written import InputSpec, PassThroughBlock, Shell, StageForward
from lightning_3d.policies.base import Plan, PolicyError

log = logging.getLogger(__name__)


def split_options(module: nn.Module, plan: Plan, split: str | list[list[str]]) -> dict:
    """``assign_blocks`` keyword arguments for ``ParallelConfig.pipeline_split``."""
    if not isinstance(split, str):
        return {"explicit": split}
    if split == "blocks":
        return {}

    def count(fqns: list[str]) -> int:
        return sum(p.numel() for fqn in fqns for p in module.get_submodule(fqn).parameters())

    return {"costs": ([count([b]) for b in plan.blocks], count(plan.before), count(plan.after))}


def check_splittable(module: nn.Module, plan: Plan) -> None:
    """Raise, naming what was found, if ``plan`` cannot cut ``module`` into pipeline stages: no blocks, no
    pipeline root, or parameters held directly by the root or on the way to the blocks (no one stage owns
    them)."""
    if not plan.blocks or plan.pipeline_root is None:
        found = ", ".join(f"{fqn} ({type(m).__name__})" for fqn, m in module.named_children()) or "none"
        what = "no repeated blocks" if not plan.blocks else "blocks but no pipeline_root"
        raise PolicyError(
            f"pipeline_parallel_size > 1 cuts the model into stages of blocks, but the plan for"
            f" {type(module).__name__} has {what}. policy='auto' looks for a ModuleList, ModuleDict or"
            f" Sequential of same-class layers inside a child of the LightningModule; the children found: {found}."
            " Keep the repeated layers in such a list, or register a policy that names them (Plan.blocks,"
            " pipeline_root, before, after), or use pipeline_parallel_size=1."
        )
    ancestors = {plan.pipeline_root} | {
        parent_fqn(fqn) for name in [*plan.blocks, *plan.before, *plan.after]
        for fqn in _prefixes(name) if fqn.startswith(plan.pipeline_root)}
    direct = [join_fqn(a, n) for a in sorted(ancestors) if a for n, _ in
              module.get_submodule(a).named_parameters(recurse=False)]
    if direct:
        raise PolicyError(
            f"Under pipeline parallelism every parameter must belong to one stage, but {direct} are held directly"
            f" by {plan.pipeline_root!r} or a module on the way to its blocks, which every stage runs. Move them"
            " into a submodule (e.g. an nn.Embedding for a position table), or use pipeline_parallel_size=1."
        )


def _prefixes(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def stage_ids_of(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pp rank runs: ``pp_rank``, ``pp_rank + pp``, ... (looped assignment)."""
    return [pp_rank + v * pp for v in range(virtual)]


def assign_blocks(blocks: list[str], num_stages: int, explicit: list[list[str]] | None = None,
                  costs: tuple[list[int], int, int] | None = None) -> list[list[str]]:
    """The blocks of each stage: ``explicit`` if given (checked); else balanced by ``costs`` if given
    (per-block parameter counts, plus what the first and the last stage carry besides blocks); else even by
    count -- when the count does not divide, the first ``len(blocks) % num_stages`` stages get one block
    more. Uneven splits are stated in the log."""
    if explicit is not None:
        flat = [b for stage in explicit for b in stage]
        if len(explicit) != num_stages or sorted(flat) != sorted(blocks) or len(set(flat)) != len(flat):
            unknown, missing = sorted(set(flat) - set(blocks)), sorted(set(blocks) - set(flat))
            repeated = sorted({b for b in flat if flat.count(b) > 1})
            found = "; ".join(f"{what}: {names}" for what, names in
                              [("not blocks of the model", unknown), ("missing", missing), ("repeated", repeated)]
                              if names)
            raise LayoutError(
                f"pipeline_split lists {len(explicit)} stages covering {len(flat)} blocks, but the layout has"
                f" {num_stages} stages and the model {len(blocks)} blocks ({blocks[0]} ... {blocks[-1]})"
                f"{'; ' + found if found else ''}. List every block exactly once, in order, one list per stage."
            )
        return [list(stage) for stage in explicit]
    if len(blocks) < num_stages:
        raise LayoutError(
            f"The model has {len(blocks)} blocks but the pipeline has pipeline_parallel_size x"
            f" virtual_pipeline_size = {num_stages} stages; every stage needs at least one block. Lower"
            " pipeline_parallel_size or virtual_pipeline_size."
        )
    if costs is not None:
        sizes = _balanced_sizes(*costs, num_stages)
    else:
        base, extra = divmod(len(blocks), num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(set(sizes)) > 1:
        log.info("lightning_3d: %d blocks over %d stages: blocks per stage %s", len(blocks), num_stages, sizes)
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [blocks[start:start + size] for start, size in zip(starts, sizes)]


def _balanced_sizes(block_costs: list[int], first_extra: int, last_extra: int, num_stages: int) -> list[int]:
    """Blocks per stage, contiguous and at least one each, minimizing the largest stage's cost (dynamic
    programming over split points; blocks and stages are few)."""
    n = len(block_costs)
    prefix = [0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, end: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[s][i]: (max cost, sizes) placing the first i blocks on the first s stages
    best: dict[tuple[int, int], tuple[int, list[int]]] = {(0, 0): (0, [])}
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            options = [(max(best[(s - 1, j)][0], stage_cost(s - 1, j, i)), best[(s - 1, j)][1] + [i - j])
                       for j in range(s - 1, i) if (s - 1, j) in best]
            best[(s, i)] = min(options)
    return best[(num_stages, n)][1]


def split_stages(module: nn.Module, plan: Plan, stage_blocks: list[list[str]], stage_ids: list[int]) -> list[nn.Module]:
    """Replace ``module``'s pipeline root by the union of the stages in ``stage_ids`` and return one module
    per local stage (sharing submodules with that union). Works on meta or materialized modules."""
    if plan.pipeline_root is None:
        raise PolicyError(
            f"The policy for {type(module).__name__} names no pipeline_root, so the model cannot be split into"
            " pipeline stages. Use a policy that names it (Plan.pipeline_root, before, after)."
        )
    root_name = plan.pipeline_root
    root = module.get_submodule(root_name)
    num_stages = len(stage_blocks)
    inputs = InputSpec()  # shared by this rank's stages that run the forward as written
    split = [*plan.blocks, *plan.before, *plan.after]
    holders = {_relative(fqn, root_name): "stage 0" for fqn in plan.before}
    holders |= {_relative(fqn, root_name): f"the last stage ({num_stages - 1})" for fqn in plan.after}
    holders |= {_relative(block, root_name): f"stage {s}" for s, blocks in enumerate(stage_blocks) for block in blocks}
    stages = []
    for stage_id in stage_ids:
        stage = copy.deepcopy(root)
        keep = set(stage_blocks[stage_id])
        keep |= set(plan.before) if stage_id == 0 else set()
        keep |= set(plan.after) if stage_id == num_stages - 1 else set()
        for fqn in split:
            if fqn not in keep:
                _remove(stage, _relative(fqn, root_name), plan.forward_as_written)
        _share_the_rest(stage, root, [_relative(fqn, root_name) for fqn in split])
        # An instance attribute shadows the class's forward; nn.Module.__call__ looks it up on the instance.
        if plan.forward_as_written:
            held = [_relative(b, root_name) for b in stage_blocks[stage_id]]
            previous = _relative(stage_blocks[stage_id - 1][-1], root_name) if stage_id > 0 else None
            stage.forward = StageForward(stage, held, stage_id=stage_id, previous_block=previous,
                                         is_last=stage_id == num_stages - 1, inputs=inputs,
                                         units=[_relative(fqn, root_name) for fqn in split if fqn in keep],
                                         holders=holders)
        elif plan.stage_forward is not None:
            stage.forward = partial(plan.stage_forward, stage)
        stages.append(stage)
    # The union: the root, emptied, then given each local stage's modules (the same objects).
    for fqn in split:
        _remove(root, _relative(fqn, root_name), plan.forward_as_written)
    for stage in stages:
        for fqn in split:
            relative = _relative(fqn, root_name)
            kept = _get(stage, relative)
            if kept is not None:
                _put(root, relative, kept)
    return stages


def _share_the_rest(stage: nn.Module, root: nn.Module, split: list[str]) -> None:
    """Make the modules no stage split owns (e.g. a rotary embedding every stage uses) the root's very
    objects, so there is one of each per rank: materialized, initialized and loaded with the rest."""
    def related(name: str) -> bool:  # a split module, inside one, or on the path to one
        return any(name == s or name.startswith(s + ".") or s.startswith(name + ".") for s in split)

    shared: list[str] = []
    for name, _ in list(stage.named_modules()):
        if name and not related(name) and not any(name.startswith(prefix + ".") for prefix in shared):
            shared.append(name)
    for name in shared:
        _put(stage, name, root.get_submodule(name))


def _relative(fqn: str, root_name: str) -> str:
    if not fqn.startswith(root_name + "."):
        raise PolicyError(f"{fqn!r} is not inside the pipeline root {root_name!r}")
    return fqn[len(root_name) + 1:]


def _parent(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent_name, _, name = fqn.rpartition(".")
    return (module.get_submodule(parent_name) if parent_name else module), name


def _get(module: nn.Module, fqn: str) -> nn.Module | None:
    parent, name = _parent(module, fqn)
    if isinstance(parent, nn.ModuleDict):
        child = parent[name] if name in parent else None
    else:
        child = getattr(parent, name, None)
    return None if isinstance(child, PLACEHOLDERS) else child


class DroppedBlock(nn.Module):
    """Holds the place of a block another stage runs, inside an ``nn.ModuleList``: the blocks after it keep
    their names. Owns nothing; a stage's forward (``Plan.stage_forward``) skips it."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a pipeline stage called a block that another stage holds; its stage_forward must"
                           " skip lightning_3d.pipeline.split.DroppedBlock entries")


PLACEHOLDERS = (DroppedBlock, PassThroughBlock, Shell)
"""What holds the place of a module another stage runs."""
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def held_modules(module: nn.Module, fqns: list[str]) -> dict[str, nn.Module]:
    """FQN -> module, for the modules named in ``fqns`` that this rank holds (not those of other stages)."""
    named = dict(module.named_modules())
    return {fqn: named[fqn] for fqn in fqns if fqn in named and not isinstance(named[fqn], PLACEHOLDERS)}


def _remove(module: nn.Module, fqn: str, as_written: bool = False) -> None:
    parent, name = _parent(module, fqn)
    if as_written:  # the forward still calls it: a placeholder takes its place (pipeline.as_written)
        child = _get(module, fqn)
        if child is not None:  # (a union root: _put gives it back what this rank holds)
            _put(module, fqn, PassThroughBlock(child) if isinstance(parent, CONTAINERS) else Shell(child))
        return
    if isinstance(parent, nn.ModuleDict):
        if name in parent:
            del parent[name]
    elif isinstance(parent, nn.Sequential):
        raise PolicyError(f"{fqn!r} sits in an nn.Sequential, whose forward would call every entry: keep the"
                          " blocks in an nn.ModuleDict keyed '0', '1', ..., or give the plan a stage_forward")
    elif isinstance(parent, nn.ModuleList):
        parent[int(name)] = DroppedBlock()
    else:
        setattr(parent, name, None)


def _put(module: nn.Module, fqn: str, child: nn.Module) -> None:
    parent, name = _parent(module, fqn)
    if isinstance(parent, nn.ModuleDict):
        parent[name] = child
    else:
        setattr(parent, name, child)
