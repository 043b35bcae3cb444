"""Which of a block's config sizes it computes with.

A model's config holds many integers that a tp split happens to divide and that the block never computes with
(a layer count, an expert count, a top-k above the traced tokens: 12 of the 13 in DeepSeek-V4's attention
config). Each is a candidate for the per-rank attribute search (:mod:`~lightning_3d.policies.tp_per_rank`),
whose subsets it would multiply; a rank-free trace of the whole block with one value changed tells the others
apart.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_3d.policies.block_trace import BlockTrace, meta_copy, trace_block


def changes_trace(block: nn.Module, args, kwargs, whole: BlockTrace, values: dict[str, dict[str, Any]]) -> bool:
    """Whether ``block`` (on the meta device), with ``values`` (module -> attribute -> value) set and nothing
    split, traces otherwise than ``whole``, its trace as it is: it fails, or its projections, the features at
    their inputs or its attention products differ."""
    local = meta_copy(block)
    for holder, attributes in values.items():
        for name, value in attributes.items():
            setattr(local.get_submodule(holder), name, value)
    trace = trace_block(local, args, kwargs)
    return (trace.problem != whole.problem or trace.order != whole.order or trace.sizes != whole.sizes
            or _events(trace) != _events(whole) or not _same_shadows(trace.row_inputs, whole.row_inputs))


def _events(trace: BlockTrace) -> list:
    return [(e.q, e.k, e.v) for e in trace.attention]


def _same_shadows(one: dict, other: dict) -> bool:
    return one.keys() == other.keys() and all(
        one[p].keys() == other[p].keys() and all(len(one[p][n]) == len(other[p][n]) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(one[p][n], other[p][n])) for n in one[p])
        for p in one)
