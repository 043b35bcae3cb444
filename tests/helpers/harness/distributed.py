"""The case on every rank of a launch (this runs inside the ranks, ``workers/parity_worker.py``): trained under
its strategy, its full state gathered by single-device names on rank 0."""

from __future__ import annotations

import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from helpers.harness.cases import Case, Result
from helpers.harness.modules import module_and_data
from helpers.harness.training import LossRecorder, model_parameters, trainer_for


def run_distributed(case: Case) -> Result | None:
    """The case on every rank of the current launch; the result on global rank 0, None elsewhere."""
    from lightning_3d import ThreeDStrategy

    world = int(os.environ["WORLD_SIZE"])
    module, data = module_and_data(case, case.global_batch_size // case.dp)
    strategy = ThreeDStrategy(**case.strategy_kwargs) if case.strategy == "3d" else case.strategy
    recorder = LossRecorder()
    trainer = trainer_for(case, strategy, world, recorder)
    trainer.fit(module, data)
    if case.save_checkpoint:
        trainer.save_checkpoint(case.save_checkpoint)
    spread: dict[str, float] = {}
    params = gather_full_state(module, spread)
    result = Result(recorder.losses, params, recorder.logged, recorder.grad_norms, model_parameters(trainer),
                    _parameter_bytes_per_rank(module), _tp_sharded_block_share(module), _tp_whole_outside_blocks(module),
                    spread)
    result.expert_elements = _expert_elements_per_rank(module)
    result.expert_loads = recorder.expert_loads
    decision = getattr(strategy, "layout_decision", None)  # layout="auto": what it chose
    result.layout = asdict(decision.layout) if decision is not None else None
    return result if dist.get_rank() == 0 else None


def _parameter_bytes_per_rank(module: torch.nn.Module) -> list[int]:
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, local)
    return per_rank


def _expert_elements_per_rank(module: torch.nn.Module) -> list[int]:
    from torch.distributed.tensor import DTensor

    from lightning_3d.policies.experts import is_dispatched_experts

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for m in module.modules()
                if is_dispatched_experts(m) for p in m.parameters(recurse=False))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, local)
    return per_rank


def _in_block(name: str) -> bool:
    return any(atom.isdigit() for atom in name.split("."))


def _tp_sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
        return False
    return isinstance(param.placements[param.device_mesh.mesh_dim_names.index("tp")], (Shard, _StridedShard))


def _tp_sharded_block_share(module: torch.nn.Module) -> list[float]:
    """Counted on each rank from its parameters' placements (see ``Result.tp_sharded_block_share``)."""
    in_blocks = [param for name, param in module.named_parameters() if _in_block(name)]
    total, sharded = sum(p.numel() for p in in_blocks), sum(p.numel() for p in in_blocks if _tp_sharded(p))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, sharded / total if total else 0.0)
    return per_rank


def _tp_whole_outside_blocks(module: torch.nn.Module) -> list[list]:
    """Per rank: (name, global shape) of each parameter outside the blocks left whole over tp."""
    whole = [(name, list(param.shape)) for name, param in module.named_parameters()
             if not _in_block(name) and not _tp_sharded(param)]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, whole)
    return per_rank


def gather_full_state(module: torch.nn.Module, spread: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full CPU tensor under its single-device FQN, on global rank 0 (other
    ranks: empty). Collective: every rank calls it. ``spread``, if given, receives on rank 0, for each tensor
    that more than one rank holds whole (replicated over tp or dp, or gathered from its shards), the largest
    difference between two ranks' copies: copies that drift apart are a wrong result, whatever rank 0 holds."""
    from torch.distributed.tensor import DTensor

    from lightning_3d.checkpoint.boxes import is_strided, local_boxes, single_device_size
    from lightning_3d.fused_parts import fused_layouts

    local = {}
    persistent = module.state_dict().keys()  # not, e.g., a rotary embedding's frequencies (as the reference)
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    layouts = fused_layouts(module)
    for name, tensor in tensors:  # tied parameters under each of their names, as in a state dict
        if name not in persistent:
            continue
        parts = layouts.get(name)
        if is_strided(tensor, parts):  # its boxes, placed on rank 0 (full_tensor misreads a dp cut over a strided tp split)
            piece = tensor.to_local().detach().cpu()
            local[name] = (tuple(single_device_size(tensor, parts)), tensor.dtype,
                           [(offsets, sizes, piece[region].clone()) for offsets, sizes, region in local_boxes(tensor, parts)])
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local[name] = full.detach().cpu().clone()
    # To rank 0 only: an all-gather had every rank unpickle every rank's copy (8 x 8 at world 8), ~10% of a
    # one-step case's CPU time.
    per_rank = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, per_rank, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for state in per_rank or []:
        for name, value in state.items():
            if isinstance(value, tuple):
                shape, dtype, boxes = value
                full = merged.setdefault(name, torch.zeros(shape, dtype=dtype))
                for offsets, sizes, piece in boxes:
                    full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = piece
            else:
                if name in merged and spread is not None:
                    gap = (merged[name].double() - value.double()).abs().max().item() if value.numel() else 0.0
                    spread[name] = max(spread.get(name, 0.0), gap)
                merged.setdefault(name, value)
    return merged
