"""A rank's piece of a DTensor as boxes of the global tensor, for checkpoints of strided shards.

DCP (and ``init_from``) describe a rank's piece of a tensor by one box -- an offset and a size per dimension --
computed from its placements. That holds for ``Shard``/``Replicate``, but not for a ``_StridedShard`` alone:
GPT-2's fused ``c_attn`` (columns ``[q | k | v]``) is split so that tp rank r holds ``[q_r | k_r | v_r]``
(``lightning_3d.policies.hf_gpt2``), i.e. three boxes of the global tensor. PyTorch then reports the first
box's offset with the size of all three, so ranks' writes would overlap. :func:`local_boxes` computes the
true boxes from the placements, and for a fused projection of unequal parts, stored in rank order
(``lightning_3d.fused_parts``), maps them back to the single-device order; :class:`BoxesSavePlanner` / :class:`BoxesLoadPlanner` give DCP one chunk per
box for such tensors. The checkpoint keeps the single-device layout, so it reshards to any layout (tp=1
included) and converts to a Hugging Face directory unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_3d.fused_parts import FusedParts, layout_of

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...]]
"""(global offsets, sizes, the region of the local tensor that holds it)."""


def local_boxes(tensor: DTensor, parts: FusedParts | None = None) -> list[Box]:
    """The boxes of the single-device tensor that this rank's local tensor holds (one, unless a strided shard
    or a fused projection stored in rank order, ``parts``, splits a dimension into several runs). No
    communication."""
    # A part every rank keeps whole is its own box, so ranks write identical boxes of it (DCP keeps one) rather
    # than overlapping ones (rank 1's last q rows run on into k: [q_1 | k | v] is one run of single-device rows).
    cuts = (set(itertools.accumulate(parts.sizes)) if parts is not None and any(parts.whole) else set())
    runs = [_runs(_global_indices(tensor, dim, parts), cuts if parts is not None and dim == parts.dim else set())
            for dim in range(tensor.ndim)]
    return [
        (tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo), tuple(slice(l, l + n) for _, l, n in combo))
        for combo in itertools.product(*runs)
    ]


def single_device_size(tensor: DTensor, parts: FusedParts | None = None) -> torch.Size:
    """The shape of ``tensor`` on one device (larger than one of a fused projection stored with whole parts
    once per rank, ``parts``)."""
    return torch.Size(parts.single_device_shape(tensor.shape)) if parts is not None else tensor.size()


def is_strided(value: object, parts: FusedParts | None = None) -> bool:
    """A DTensor whose local piece is more than one box of the single-device tensor, or is stored in rank order
    (``parts``: even one box of it lies elsewhere than its placements say)."""
    if not isinstance(value, DTensor):
        return False
    if parts is not None:
        return True
    return any(isinstance(p, _StridedShard) for p in value.placements) and len(local_boxes(value)) > 1


def _global_indices(tensor: DTensor, dim: int, parts: FusedParts | None = None) -> Tensor:
    """The global indices along ``dim`` of the local tensor's entries, in local order, from the placements that
    split ``dim``: a ``Shard`` takes its chunk, a ``_StridedShard`` alone its slice of each of ``split_factor``
    parts. A ``_StridedShard`` followed by another split of ``dim`` is FSDP2's mark of a dp cut made on the
    tp-local piece: the inner split first, then a chunk of what it left. (``distribute_tensor`` and
    ``full_tensor`` read a dp cut over a *strided* tp split otherwise than FSDP2 lays it out: a fused q|k|v
    bias under ZeRO.) For a tensor stored in rank order (``parts``), the stored positions are then mapped to
    single-device ones. No communication."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    index = torch.arange(tensor.shape[dim])
    splits = [(m, p) for m, p in enumerate(tensor.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(splits) == 2 and isinstance(splits[0][1], _StridedShard):
        splits = [splits[1], (splits[0][0], Shard(dim))]
    for m, placement in splits:
        size, rank = mesh.size(m), coordinate[m]
        if isinstance(placement, _StridedShard):
            index = torch.cat([_chunk(part, size, rank) for part in index.chunk(placement.split_factor)])
        else:
            index = _chunk(index, size, rank)
    if parts is not None and dim == parts.dim:
        index = parts.single_device_index()[index]
    return index


def _chunk(index: Tensor, size: int, rank: int) -> Tensor:
    """``rank``'s piece of ``index`` cut in ``size`` as ``Shard`` cuts (``torch.chunk``; empty past the end)."""
    pieces = index.chunk(size)
    return pieces[rank] if rank < len(pieces) else index[:0]


def _runs(index: Tensor, cuts: set[int] = frozenset()) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices, none crossing an index of ``cuts``: (global start, local
    start, length)."""
    values = index.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1 or values[i] in cuts:
            runs.append((values[start], start, i - start))
            start = i
    return runs


def _box_at(tensor: DTensor, offsets, parts: FusedParts | None) -> Tensor:
    """The local view of the box that starts at ``offsets``."""
    for box_offsets, _, region in local_boxes(tensor, parts):
        if tuple(box_offsets) == tuple(offsets):
            return tensor.to_local()[region]
    raise KeyError(f"no local box at {tuple(offsets)}")


def _strided(state_dict: dict, layouts: dict[str, FusedParts]) -> dict[str, tuple[DTensor, FusedParts | None]]:
    found = {}
    for fqn, value in state_dict.items():
        parts = layout_of(fqn, layouts) if isinstance(value, DTensor) else None
        if is_strided(value, parts):
            found[fqn] = (value, parts)
    return found


class BoxesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with one write item per box for strided DTensors and for the tensors
    stored in rank order that ``layouts`` names (``lightning_3d.fused_parts.fused_layouts``)."""

    def __init__(self, layouts: dict[str, FusedParts] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layouts = layouts or {}

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.strided = strided = _strided(self.state_dict, self.layouts)  # found once; resolve_data asks per item
        if strided:
            items = [item for item in plan.items if item.index.fqn not in strided]
            for fqn, (tensor, parts) in strided.items():
                properties = TensorProperties.create_from_tensor(tensor.to_local())
                for offsets, sizes, _ in local_boxes(tensor, parts):
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                    items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk=chunk, properties=properties,
                                                                       size=single_device_size(tensor, parts))))
            plan = dataclasses.replace(plan, items=items)
            self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem):
        found = self.strided.get(write_item.index.fqn)
        if found is not None:
            return _box_at(found[0], write_item.index.offset, found[1]).clone()  # a view would save all the storage
        return super().resolve_data(write_item)


class BoxesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading strided DTensors, and the tensors stored in rank order that
    ``layouts`` names, box by box, in place."""

    def __init__(self, layouts: dict[str, FusedParts] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layouts = layouts or {}

    def create_local_plan(self):
        self.strided = strided = _strided(self.state_dict, self.layouts)
        # DCP's own plan sees them as placeholders of their single-device shape (it checks a tensor's size, and a
        # whole part is stored once per rank); their read items are this planner's.
        everything = self.state_dict
        self.state_dict = {k: torch.empty(single_device_size(*strided[k]), device="meta") if k in strided else v
                           for k, v in everything.items()}
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict = everything
        if strided:
            items = [item for item in plan.items if item.dest_index.fqn not in strided]
            for fqn, (tensor, parts) in strided.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                          for o, s, _ in local_boxes(tensor, parts)]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            plan = dataclasses.replace(plan, items=items)
        return plan

    def resolve_tensor(self, read_item):
        found = self.strided.get(read_item.dest_index.fqn)
        if found is not None:
            return self.transform_tensor(read_item, _box_at(found[0], read_item.dest_index.offset, found[1]))
        return super().resolve_tensor(read_item)
