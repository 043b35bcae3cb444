"""Terms an attention adds to each head's scores from projections of its own, followed to their heads.

Some attentions add to each head's scores terms that projections compute from the hidden states: a relative
position bias (a projection gives each token per-head states, which mix a bank of bias-vs-distance profiles,
a weight of the module applied by hand, gathered by distance) and attention sinks (a projection gives one logit
per head, concatenated to the scores before the softmax). Each head's term reads only that head's features of
the projection, so the projection splits with the heads, as q does (``HeadEvent.scores``). The block trace
(:mod:`~lightning_3d.policies.block_trace`) follows the features on that way through:

* a product of features with a weight matrix applied by hand (not a projection's, followed by no shadow):
  each output carries every feature of its input's row (:func:`weighed`);
* ``gather`` along a dimension over which each place holds the same features (the bias gathered by distance):
  each output place holds them, whichever the index picks (:func:`gathered`);
* the softmax of the scores: each weight depends on every term of its row, the sink's too (:func:`rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rows(slots: list[Tensor], dim: int) -> list[Tensor]:
    """Slots in which each place holds the features of every place of its row along ``dim``: a slot already
    the same all along it is kept, of the others one slot per place, and slots holding no feature are dropped
    (unless all do)."""
    found = []
    for s in slots:
        if torch.equal(s, s.narrow(dim, 0, 1).expand_as(s)):
            found.append(s)
        else:
            found += [s.narrow(dim, k, 1).expand_as(s).clone() for k in range(s.shape[dim])]
    held = [s for s in found if (s >= 0).any()]
    return held or found[:1]


def weighed(slots: list[Tensor], shape) -> list[Tensor]:
    """The slots of ``x @ w`` (``x`` (N, K) of these slots, ``w`` (K, M) a weight, ``shape`` (N, M)): each
    output of row n holds the features of all of row n of ``x``."""
    return [s[:, :1].expand(shape).clone() for s in rows(slots, 1)]


def gathered(slots: list[Tensor], dim: int, shape) -> list[Tensor] | None:
    """The slots of ``gather(x, dim, index)`` (``shape``: the index's) from those of ``x``, each of which holds
    the same feature all along ``dim``; None where one does not (the index's values are not read)."""
    found = []
    dim %= len(shape)
    for s in slots:
        first = s.narrow(dim, 0, 1)
        if not torch.equal(s, first.expand_as(s)):
            return None
        for d, size in enumerate(shape):
            if d != dim:
                first = first.narrow(d, 0, size)
        found.append(first.expand(shape).clone())
    return found
