"""Weights of one value per feature of a split projection's output, split with those features.

Some attention and mixing modules apply, beside their projections, a weight of their own to each output
feature of one: nGPT's per-feature query scale (``sqk``) and gate scale, RWKV's ``time_decay`` and
``time_first`` on each key channel. At tp, rank r computes its share of those features, so it keeps those
features' values of the weight (``Shard`` along :func:`split_dim`, :class:`~lightning_3d.policies.head_weights.HeadWeights`).

No shape is guessed at: the block trace (:mod:`~lightning_3d.policies.block_trace`) follows each element of the
own weights of the modules that hold projections as it follows projection features, and records them apart
(:func:`set_apart`): which elements sit at each input of a projection, and on each side of each head of an
attention product. A weight is split when every one of its elements meets the features of exactly one rank,
and each rank's elements are its slice of the weight (:func:`split_with_features`).
"""

from __future__ import annotations

from torch import Tensor, nn

from lightning_3d.common import join_fqn


def tracked_weights(block: nn.Module, is_projection) -> dict[int, str]:
    """Tensor id -> FQN (relative to ``block``) of the own parameters of the modules that hold projections:
    the block itself, its attention, its MLP (not a projection's own weights, nor a norm's)."""
    holders = [fqn for fqn, module in block.named_modules()
               if not is_projection(module) and any(is_projection(m) for m in module.modules())]
    return {id(p): join_fqn(holder, name) for holder in holders
            for name, p in block.get_submodule(holder).named_parameters(recurse=False)}


def set_apart(trace, weights: set[str]) -> None:
    """Move the ``weights``' elements out of ``trace``'s attention sides (which then hold projection features
    only) into each event's ``weights``; drop them from the convolutions' channels. (The trace records them
    apart at projection inputs itself: ``row_weights``.)"""
    for event in trace.attention:
        heads = len(event.q)
        event.weights = [{} for _ in range(heads)]
        for side in (event.q, event.k, event.v):
            for h, features in enumerate(side[:heads]):
                for name in [n for n in features if n in weights]:
                    event.weights[h][name] = event.weights[h].get(name, frozenset()) | features.pop(name)
    for channels in trace.depthwise.values():
        for features in channels:
            for name in [n for n in features if n in weights]:
                del features[name]


def split_with_features(block: nn.Module, trace, row: str, event, heads: int | None, tp: int) -> dict[str, list[str]]:
    """Module -> its own weights (names) that split with the region's features over ``tp`` ranks: every element
    met by the features of one rank only (its heads, or its slice of the row's inputs), all elements met, and
    rank r's elements the r-th slice of the weight along its first dimension."""
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
    found: dict[str, list[str]] = {}
    for fqn, shares in met.items():
        weight = block.get_parameter(fqn)
        if _sliced(weight, shares, tp):
            owner, _, leaf = fqn.rpartition(".")
            found.setdefault(owner, []).append(leaf)
    return found


def split_dim(weight: Tensor) -> int:
    """The dimension along which a weight of one value per head or feature splits: its first of more than one
    element (Kimi's ``A_log``, shaped ``(1, 1, heads, 1)`` to broadcast, splits along its heads), where rank r's
    slice holds the r-th run of its elements in memory order."""
    return next((d for d, size in enumerate(weight.shape) if size > 1), 0)


def _sliced(weight: Tensor, shares: list[set[int]], tp: int) -> bool:
    """Whether rank r's elements of ``weight`` (flat indices) are exactly its r-th slice along
    :func:`split_dim`."""
    if not weight.dim() or weight.shape[split_dim(weight)] % tp:
        return False
    size = weight.numel() // tp
    return all(share == set(range(r * size, (r + 1) * size)) for r, share in enumerate(shares))
