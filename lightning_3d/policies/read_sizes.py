"""Which of a block's attributes and config sizes it computes with.

A model's config holds many integers that a tp split happens to divide and that the block never computes with
(a layer count, an expert count, a top-k above the traced tokens: 12 of the 13 in DeepSeek-V4's attention
config). Each is a candidate for the per-rank attribute search (:mod:`~lightning_3d.policies.tp_per_rank`),
whose subsets it would multiply; a rank-free trace of the whole block with one value changed tells the others
apart.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from lightning_3d.common import join_fqn
from lightning_3d.policies.block_trace import BlockTrace, meta_copy, trace_block


@contextmanager
def attribute_reads(block: nn.Module) -> Iterator[dict[str, set[str]]]:
    """While entered, the attributes read off ``block``'s modules and their configs: module FQN (relative to
    the block; ``FQN.config`` for its config's values) -> the names read. A value never read while the block runs
    cannot change what it computes: the per-rank search (:mod:`~lightning_3d.policies.tp_per_rank`) need not
    try it (most of a config is read only while the model is built; ``nn.Linear.out_features`` never)."""
    reads: dict[str, set[str]] = {}
    owners: dict[int, tuple[Any, set[str]]] = {}  # each object once (a config is shared by the modules)
    for fqn, module in block.named_modules():
        owners.setdefault(id(module), (module, reads.setdefault(fqn, set())))
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, (nn.Module, torch.Tensor)):
            found = owners.setdefault(id(config), (config, set()))[1]
            reads[join_fqn(fqn, "config")] = found
    changed = []
    for owner, names in owners.values():
        cls = type(owner)
        try:
            owner.__class__ = _recording_class(cls, names)
            changed.append((owner, cls))
        except TypeError:  # an instance that cannot change class (__slots__): every value counts as read
            names.update(vars(owner))
    try:
        yield reads
    finally:
        for owner, cls in changed:
            owner.__class__ = cls


def _recording_class(cls: type, reads: set[str]) -> type:
    """A subclass of ``cls`` that adds to ``reads`` the name of every attribute read off its instances (and the
    name a config's ``attribute_map`` gives it: transformers' aliases, ``n_head`` for ``num_attention_heads``)."""

    aliases = getattr(cls, "attribute_map", None)
    aliases = aliases if isinstance(aliases, dict) else {}

    def __getattribute__(self, name: str):
        reads.add(name)
        if name in aliases:
            reads.add(aliases[name])
        return cls.__getattribute__(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})


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
