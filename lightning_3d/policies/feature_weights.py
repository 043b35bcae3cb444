"""Weights of one value per feature of a split projection's output, split with those features.

Some attention and mixing modules apply, beside their projections, a weight of their own to each output
feature of one: nGPT's per-feature query scale (``sqk``) and gate scale, RWKV's ``time_decay`` and
``time_first`` on each key channel. At tp, rank r computes its share of those features, so it keeps those
features' values of the weight (``Shard`` along :func:`split_dim`, :class:`~lightning_3d.policies.head_weights.HeadWeights`).

A non-persistent buffer of such a module is followed alike (Falcon-H1's ``mup_vector``, one multiplier per
output feature of its fused ``[z | x | B | C | dt]`` projection). It may follow a fused projection's parts,
some of which every rank keeps whole (B and C of one group): rank r reads the values at the single-device
positions of its local features, in their order (``FusedParts.held_by``). The buffer itself stays whole, as
the model built it: whatever initializes it later (a replay of the build, rank 0's weights) writes the
single-device values. A persistent buffer is not followed: it would stay whole and be read whole, so a
split of the features it meets is refused by the per-rank trace.

No shape is guessed at: the block trace (:mod:`~lightning_3d.policies.block_trace`) follows each element of the
own weights of the modules that hold projections as it follows projection features, and records them apart
(:func:`set_apart`): which elements sit at each input of a projection, and on each side of each head of an
attention product. A weight is split when every one of its elements meets the features of exactly one rank,
and each rank's elements are its slice of the weight (:func:`split_with_features`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_3d.common import join_fqn

Parts = tuple[tuple[int, ...], tuple[bool, ...]]
"""The sizes of consecutive parts along a dimension, and per part whether every rank keeps it whole."""
Cut = Callable[[list[list[int]], int, int, set[int]], "Parts | None"]
"""(each rank's positions, in order; their number; tp; those every rank holds) -> their :data:`Parts`, or None."""


def tracked_weights(block: nn.Module, is_projection) -> dict[int, str]:
    """Tensor id -> FQN (relative to ``block``) of the own parameters and non-persistent floating-point buffers
    of the modules that hold projections: the block itself, its attention, its MLP (not a projection's own
    weights, nor a norm's). A buffer larger than the holder's projections' outputs together (a causal mask)
    holds no value per feature and is not followed."""
    found = {}
    for holder, module in block.named_modules():
        projections = [m for m in module.modules() if is_projection(m)]
        if is_projection(module) or not projections:
            continue
        found.update({id(p): join_fqn(holder, name) for name, p in module.named_parameters(recurse=False)})
        widest = sum(max(m.weight.shape) for m in projections)  # at least their output features together
        buffers = dict(module.named_buffers(recurse=False))
        saved = _own_saved(module) if buffers else set()  # registered persistent=False: not in the state dict
        found.update({id(b): join_fqn(holder, name) for name, b in buffers.items()
                      if name not in saved and b.is_floating_point() and b.numel() <= widest})
    return found


def set_apart(trace, weights: set[str]) -> None:
    """Move the ``weights``' elements out of ``trace``'s attention sides (which then hold projection features
    only) into each event's ``weights``; drop them from the convolutions' channels. (The trace records them
    apart at projection inputs itself: ``row_weights``.)"""
    for event in trace.attention:
        heads = len(event.q)
        event.weights = [{} for _ in range(heads)]
        for side in (event.q, event.k, event.v, event.scores):
            for h, features in enumerate(side[:heads]):
                for name in [n for n in features if n in weights]:
                    event.weights[h][name] = event.weights[h].get(name, frozenset()) | features.pop(name)
    for channels in trace.depthwise.values():
        for features in channels:
            for name in [n for n in features if n in weights]:
                del features[name]


def split_with_features(block: nn.Module, trace, row: str, event, heads: int | None, tp: int,
                        cut: Cut) -> dict[str, dict[str, Parts]]:
    """Module -> its own weights (names) that split with the region's features over ``tp`` ranks -> the sizes of
    the parts along :func:`split_dim` of which rank r keeps chunk r each, and which every rank keeps whole.
    Every element is met by the features of one rank only (its heads, or its slice of the row's inputs), all
    are met, and rank r's are its r-th slice (a parameter), or its chunk of each of consecutive parts, or a
    part all ranks meet (a buffer: ``cut``, ``tp_structure``'s reading of a fused projection's shares)."""
    met: dict[str, list[set[int]]] = {}
    if event is not None and heads:
        for h, weights in enumerate(getattr(event, "weights", [])):
            for name, elements in weights.items():
                met.setdefault(name, [set() for _ in range(tp)])[h // (heads // tp)] |= elements
    width = trace.sizes[row][0]
    for name, slots in trace.row_weights.get(row, {}).items():
        for rank in range(tp):
            part = slice(rank * width // tp, (rank + 1) * width // tp)
            met.setdefault(name, [set() for _ in range(tp)])[rank] |= {
                int(i) for s in slots for i in s[..., part].flatten().tolist() if i >= 0}
    found: dict[str, dict[str, Parts]] = {}
    for fqn, shares in met.items():
        owner, _, leaf = fqn.rpartition(".")
        module = block.get_submodule(owner)
        if leaf in dict(module.named_parameters(recurse=False)):
            weight = module.get_parameter(leaf)
            parts = ((weight.shape[split_dim(weight)],), (False,)) if _sliced(weight, shares, tp) else None
        else:
            parts = _buffer_parts(module.get_buffer(leaf), shares, tp, cut)
        if parts is not None:
            found.setdefault(owner, {})[leaf] = parts
    return found


def split_dim(weight: Tensor) -> int:
    """The dimension along which a weight of one value per head or feature splits: its first of more than one
    element (Kimi's ``A_log``, shaped ``(1, 1, heads, 1)`` to broadcast, splits along its heads), where rank r's
    slice holds the r-th run of its elements in memory order."""
    return next((d for d, size in enumerate(weight.shape) if size > 1), 0)


def _buffer_parts(buffer: Tensor, shares: list[set[int]], tp: int, cut: Cut) -> Parts | None:
    """The parts along :func:`split_dim` of which rank r's elements of ``buffer`` (flat indices) are its chunk
    each, or whole parts; None if they are not whole positions along it, or no position is rank r's alone."""
    if not buffer.dim():
        return None
    dim = split_dim(buffer)
    index = torch.arange(buffer.numel()).view(buffer.shape)  # flat index -> its place
    size, stride = buffer.shape[dim], index.stride(dim)
    positions = [{i // stride % size for i in share} for share in shares]
    for share, held in zip(shares, positions):  # each rank meets every element at its positions
        if share != set(index.index_select(dim, torch.tensor(sorted(held), dtype=torch.long)).flatten().tolist()):
            return None
    shared = set.intersection(*positions) if tp > 1 else set()
    if shared == set(range(size)) or set.union(*positions) != set(range(size)) or any(
            sum(p in held for held in positions) not in (1, tp) for p in range(size)):
        return None
    return cut([sorted(held) for held in positions], size, tp, shared)


def _own_saved(module: nn.Module) -> set[str]:
    """The names of ``module``'s own tensors in its state dict (its persistent buffers among them)."""
    return {name for name in module.state_dict(keep_vars=True) if "." not in name}


def _sliced(weight: Tensor, shares: list[set[int]], tp: int) -> bool:
    """Whether rank r's elements of ``weight`` (flat indices) are exactly its r-th slice along
    :func:`split_dim`."""
    if not weight.dim() or weight.shape[split_dim(weight)] % tp:
        return False
    size = weight.numel() // tp
    return all(share == set(range(r * size, (r + 1) * size)) for r, share in enumerate(shares))
