"""Vocabulary-parallel cross-entropy for an unchanged ``training_step``.

Under tensor parallelism the output head leaves the logits sharded over the vocabulary (a DTensor), so the
full ``(tokens, vocab)`` logits never exist on one rank. The user's ``F.cross_entropy(logits, targets)``
(or ``nn.CrossEntropyLoss``, which calls it) still works: the head's output is a
:class:`~lightning_3d.parallel.sharded_logits.ShardedLogits`, whose ``__torch_function__`` sends
cross-entropy to PyTorch's ``loss_parallel`` (log-softmax reduced across the shards: two small all-reduces
per call) and hands back an ordinary tensor, so logging and everything after it is as on one device;
whatever else the step does with the logits sees one device's tensor too. The loss-parallel ops must be on
for its backward as well: the strategy holds :func:`vocab_parallel_loss` over the step and the backward
(a switch in DTensor's dispatcher, not a mode: nothing runs per torch call).

Outside a strategy step, :func:`vocab_parallel_cross_entropy` is the same computation as a plain function.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_3d.common import local


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, **kwargs: Any) -> Tensor:
    """``F.cross_entropy`` on logits sharded over the class dimension, returning a plain tensor.

    Example::

        logits = model(tokens)                     # DTensor, (B, T, V) sharded on V
        loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten())
    """
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits, targets, **kwargs)
    with vocab_parallel_ops():
        loss = F.cross_entropy(logits, targets, **kwargs)
    # The loss is replicated on every tp rank: its local value is the whole value. ``to_local`` hands back a
    # view; the step's loss may leave a module that FSDP2 wraps (the root, under dp > 1), which hooks its
    # backward onto the output -- and an in-place change of a view (``loss /= n``) drops that hook silently
    # (FSDP2 warns of it on every step). The copy is one number.
    return local(loss).clone()


_depth = 0  # how many vocab_parallel_ops() contexts are open (PyTorch's loss_parallel does not nest)


@contextmanager
def vocab_parallel_ops() -> Iterator[None]:
    """PyTorch's ``loss_parallel()``, re-entrant: leaving an inner one must not switch off an outer one
    (under pipeline parallelism the schedule's backward runs inside the context that also wraps the loss)."""
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    _depth = 1
    try:
        with loss_parallel():
            yield
    finally:
        _depth = 0


@contextmanager
def vocab_parallel_loss() -> Iterator[None]:
    """For a strategy step and its backward: PyTorch's loss-parallel ops on, so that ``F.cross_entropy`` on
    marked logits (``parallel.sharded_logits``) and its backward run on the vocabulary shards."""
    with vocab_parallel_ops():
        yield
