"""A fused projection of unequal parts split over tp: stored rank by rank, read and written in single-device order.

A fused ``[q | k | v]`` with fewer key/value heads than query heads (Phi-3 with grouped-query attention) has
parts of H·d, KV·d and KV·d output features, and tp rank r needs its chunk of each, ``[q_r | k_r | v_r]``:
neither one slice of the weight (``Shard``) nor the same slice of equal parts (``_StridedShard``). DTensor
has no placement for that cut, and a placement of one's own does not survive its operators, which rebuild
placements from the standard types.

A fused ``[q | k | v]`` with fewer key/value heads than tp ranks (Falcon's multi-query attention: one kv head)
cannot split its k and v at all: every rank keeps them whole (a *whole* part), ``[q_r | k | v]``, and the
gradient of those rows, which each rank gets only for its own query heads, is summed over tp by the projection
(``policies.projections.ColumnSplit``).

So such a weight is stored with its features in rank order, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (a whole part
once per rank: ``[q_0 k v | q_1 k v]``), and split with a plain ``Shard``: every DTensor operator is exact on it, and each rank computes with its
``[q_r | k_r | v_r]``. The order is recorded on the module that holds the weight (:class:`FusedParts`, found
with :func:`fused_layouts`). What exchanges the weight with the world outside the run maps through it
(``checkpoint.boxes.local_boxes``): its initialization, ``init_from``, checkpoints (the optimizer's state of it
too) and the state gathered for export. They all see the single-device layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Placement

ATTRIBUTE = "_lightning_3d_fused_parts"
"""On a module: parameter name -> :class:`FusedParts` of the parameters stored in rank order."""


@dataclass(frozen=True)
class FusedParts:
    """Along ``dim``, the consecutive parts ``sizes`` of the single-device tensor, stored as each of ``ranks``
    ranks' chunk of every part, rank after rank.

    Example (4 query heads and 2 kv heads of 8 features, tp=2)::

        FusedParts(0, (32, 16, 16), 2).single_device_index()  # rows 0:16, 32:40, 48:56, then 16:32, 40:48, 56:64
    """

    dim: int
    sizes: tuple[int, ...]
    ranks: int
    whole: tuple[bool, ...] = ()
    """Per part: kept whole by every rank (default: none is)."""

    def is_whole(self, part: int) -> bool:
        return bool(self.whole) and self.whole[part]

    def single_device_index(self) -> Tensor:
        """For each stored position along ``dim``, its position in the single-device tensor (a whole part's
        positions once per rank)."""
        return torch.cat([self._held(r, part) for r in range(self.ranks) for part in range(len(self.sizes))])

    def held_by(self, rank: int) -> list[int]:
        """The single-device positions ``rank`` holds, in its stored order."""
        return torch.cat([self._held(rank, part) for part in range(len(self.sizes))]).tolist()

    def _held(self, rank: int, part: int) -> Tensor:
        start, size = sum(self.sizes[:part]), self.sizes[part]
        if self.is_whole(part):
            return torch.arange(start, start + size)
        return torch.arange(start + rank * (size // self.ranks), start + (rank + 1) * (size // self.ranks))

    def whole_rows(self) -> list[tuple[int, int]]:
        """(start, length) of each whole part within one rank's stored piece, in its order."""
        found, start = [], 0
        for part, size in enumerate(self.sizes):
            length = size if self.is_whole(part) else size // self.ranks
            if self.is_whole(part):
                found.append((start, length))
            start += length
        return found

    def single_device_shape(self, stored_shape) -> tuple[int, ...]:
        """The single-device shape of a tensor stored in this order with ``stored_shape``."""
        shape = list(stored_shape)
        shape[self.dim] = sum(self.sizes)
        return tuple(shape)

    def stored(self, tensor: Tensor) -> Tensor:
        """``tensor`` (single-device order) in the stored order."""
        return tensor.index_select(self.dim, self.single_device_index().to(tensor.device))


def record(module: nn.Module, name: str, parts: FusedParts) -> None:
    """Record that ``module``'s parameter ``name`` is stored in ``parts``' order."""
    layouts = module.__dict__.setdefault(ATTRIBUTE, {})
    layouts[name] = parts


def fused_layouts(root: nn.Module) -> dict[str, FusedParts]:
    """Every parameter of ``root`` stored in rank order, by FQN (relative to ``root``)."""
    return {f"{prefix}.{name}" if prefix else name: parts
            for prefix, module in root.named_modules() for name, parts in module.__dict__.get(ATTRIBUTE, {}).items()}


def layout_of(key: str, layouts: dict[str, FusedParts]) -> FusedParts | None:
    """The layout of the parameter that a state-dict key names: the key is its FQN, or holds it between dots
    (a checkpoint's ``model.<fqn>``, the optimizer's ``optimizer_0.state.<fqn>.exp_avg``)."""
    if not layouts:
        return None
    if key in layouts:
        return layouts[key]
    dotted = f".{key}."
    return next((parts for fqn, parts in layouts.items() if f".{fqn}." in dotted), None)


def distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement,
                src_data_rank: int | None, order: FusedParts | None = None) -> bool:
    """Split ``module.name`` (stored in ``order`` first, if given); False if the module has no such tensor."""
    param = getattr(module, name, None)
    if param is None:
        return False
    with torch.no_grad():
        stored = order.stored(param) if order is not None else param
    sharded = distribute_tensor(stored, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return True
