"""What a step sees of logits sharded over the vocabulary: one device's tensor, for everything.

With ``vocab_parallel_loss`` the output head leaves its logits as a DTensor sharded on the class dimension, so
``F.cross_entropy`` never needs the whole ``(tokens, vocab)`` logits on one rank (``parallel.loss``). A step
does more with logits than the loss: ``argmax`` for an accuracy, a torchmetrics object, ``masked_fill`` with
a plain mask, ``log_softmax(-1).gather(...)``. On a bare DTensor those fail (``got mixed torch.Tensor and
DTensor``, ``aten._unique2``) or hand back DTensors that fail later. So the head marks its output
(:func:`mark_logits_of`): the DTensor becomes a :class:`ShardedLogits`, whose ``__torch_function__`` decides,
per torch call on it:

* ``F.cross_entropy``: the vocabulary-parallel loss (two small all-reduces, never the whole logits);
* a call that keeps the logits' layout (``view``, ``flatten``, ``float``, slicing tokens, elementwise with a
  number): run on the shards, and the result is marked in turn, so ``logits[:, :-1].flatten(0, 1)`` still
  reaches the cheap loss;
* anything else: PyTorch's DTensor result made whole (``full_tensor``, differentiable), or, where the call
  also takes a plain tensor, the logits gathered first. Rank 0 says so, once.

Only calls that take the logits pay for this: a tensor subclass, not a mode, so no Python runs for any other
torch call of the forward or backward (a ``TorchFunctionMode`` held over the step would run Python on every
torch call of the whole model, forward, backward and recompute).

An in-place change of marked logits that must gather (``logits.masked_fill_(plain_mask, ...)``) is refused
with the out-of-place spelling: filling a gathered copy would leave ``logits`` unchanged, silently.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from lightning_3d.errors import StepPatternError
from lightning_3d.parallel.loss import vocab_parallel_cross_entropy

_said = False  # whether rank 0 has said that a call on the logits made them whole (once per process)


def mark_logits_of(module: nn.Module) -> None:
    """Mark the DTensor outputs of ``module`` (a head whose tensor-parallel style leaves its output sharded on
    the last dimension) as logits sharded over the vocabulary."""
    module.register_forward_hook(lambda _module, _inputs, output: tree_map(_mark, output))


def is_sharded_logits(value: Any) -> bool:
    return isinstance(value, ShardedLogits)


def whole(value: Any) -> Any:
    """``value`` with any marked logits in it (a step's returned dict, say) made whole tensors."""
    return tree_map(lambda v: v.full_tensor() if is_sharded_logits(v) else v, value)


class ShardedLogits(DTensor):
    """A DTensor of logits sharded over the vocabulary that behaves as one device's tensor (see the module
    docstring). Made only by :func:`mark_logits_of`'s hook, which re-classes the head's output in place."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Below, torch calls on these tensors run as on any DTensor (no recursion into this method).
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.cross_entropy and args and isinstance(args[0], DTensor):
                return vocab_parallel_cross_entropy(*args, **kwargs)
            marked = _marked(args, kwargs)
            if marked is None:  # a marked tensor only in a nested argument: as any DTensor
                return func(*args, **kwargs)
            if _takes_plain_tensor(args, kwargs):
                if _in_place(func):
                    raise StepPatternError(_in_place_message(func))
                _say_gathered(func, marked)
                return func(*whole(args), **whole(kwargs))
            output = func(*args, **kwargs)
            return tree_map(lambda value: _kept_or_whole(value, marked, func), output)


def _mark(value: Any) -> Any:
    if isinstance(value, DTensor) and not isinstance(value, ShardedLogits):
        value.__class__ = ShardedLogits  # the same tensor, autograd history and DTensor state kept
    return value


def _marked(args: tuple, kwargs: dict) -> DTensor | None:
    """The first marked tensor among the call's arguments (one level into lists, as ``torch.cat`` takes)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            for item in value:
                if is_sharded_logits(item):
                    return item
        elif is_sharded_logits(value):
            return value
    return None


def _takes_plain_tensor(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(item, Tensor) and not isinstance(item, DTensor) for item in items):
            return True
    return False


def _kept_or_whole(value: Any, logits: DTensor, func) -> Any:
    """A DTensor result still laid out as the logits (sharded on its last dimension, the vocabulary whole in
    its shape) stays sharded and marked; any other DTensor result is made a whole tensor."""
    if not isinstance(value, DTensor):
        return value
    placements = value.placements
    if (value.ndim and len(placements) == 1 and placements[0].is_shard() and value.shape[-1] == logits.shape[-1]
            and placements[0].dim % value.ndim == value.ndim - 1):
        return _mark(value)
    _say_gathered(func, logits)
    return value.full_tensor()


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))


def _name(func) -> str:
    return getattr(func, "__name__", repr(func))


def _say_gathered(func, logits: DTensor) -> None:
    global _said
    if _said:
        return
    _said = True
    rank_zero_info(f"lightning_3d: the step calls `{_name(func)}` (maybe more) on logits sharded over the vocabulary"
                   f" (vocab_parallel_loss=True, {tuple(logits.shape)}): such calls give one device's results,"
                   " gathering the logits over tp where they need them whole; F.cross_entropy never does")


def _in_place_message(func) -> str:
    name = _name(func)
    if name == "__setitem__":
        spelled = "`logits = logits.masked_fill(mask, value)` or `logits = torch.where(mask, value, logits)`"
    else:
        spelled = f"`logits = logits.{name[3:-2] if name.startswith('__i') else name.rstrip('_')}(...)`"
    return (f"`{name}` changes the logits in place with a plain tensor, but the logits are sharded over the"
            f" vocabulary (vocab_parallel_loss=True): only a gathered copy would change. Write it out of place"
            f" ({spelled}), or set vocab_parallel_loss=False to have whole logits")
