"""A block's inputs with one slice per attention head, cut to this tp rank's heads.

Some models compute a per-head tensor once, outside the blocks, and hand it to every block: BLOOM's ALiBi
bias, ``(batch x heads, 1, tokens)``; MPT's, ``(heads, 1, tokens)``; CPM-Ant's position bias, ``(batch, heads,
q, k)``, looked up in a learned table. At tp, rank r computes heads ``[r H/tp, (r+1) H/tp)``, so its blocks must
get those heads' slices: :class:`HeadInputs` cuts them on the way into the block (a forward pre-hook), as
:func:`cut` cuts them for the shrunk block's trace that found them (:mod:`~lightning_3d.policies.tp_structure`).
The dimension holding the heads, the first or the second, is read as (groups, heads): one group, or the batch.

Where the input carries a gradient (CPM-Ant's table), each rank's gradient of it covers its own heads only:
it is summed over tp on the way back, so every rank's copy of what computed it gets the whole gradient.

The shrunk block's trace follows each element of a cut input (:func:`traced`): per head, the elements that
reach the attention scores must be those the whole block's head reads, or the cut is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_3d.policies.local_tensors import gradient_summed

Key = tuple[str, Any, int]
"""Where an input is, ("arg", position) or ("kwarg", name), and the dimension holding its heads."""


def candidates(args: tuple, kwargs: dict, heads: int) -> list[Key]:
    """The block's tensor inputs, besides the hidden states (the first), with their first or second dimension
    holding a whole number of times the heads."""
    keys = [("arg", i) for i in range(len(args))] + [("kwarg", name) for name in kwargs]
    tensors = [(key, _get(args, kwargs, key)) for key in keys]
    tensors = [(key, t) for key, t in tensors if isinstance(t, Tensor)][1:]
    return [(*key, dim) for key, t in tensors for dim in (0, 1)
            if t.dim() > dim and t.shape[dim] >= heads and t.shape[dim] % heads == 0]


def cut(args: tuple, kwargs: dict, keys: list[Key], heads: int, rank: int, tp: int) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` with each input of ``keys`` cut to tp rank ``rank``'s heads."""
    return _changed(args, kwargs, keys, lambda x, dim: _heads_of(x, dim, heads, rank, tp))


def traced(args: tuple, kwargs: dict, keys: list[Key], heads: int, rank: int | None = None,
           tp: int = 1) -> tuple[tuple, dict, dict[int, tuple[str, Tensor]]]:
    """``args`` / ``kwargs`` with the inputs ``keys`` cut to tp rank ``rank``'s heads (whole if None), and for
    each of them, by tensor id, its name and the flat index in the whole input of each of its elements: what
    the block trace follows (:func:`~lightning_3d.policies.block_trace.trace_block`)."""
    index = {key: torch.arange(t.numel()).view(t.shape) for key in keys if (t := _get(args, kwargs, key)) is not None}
    if rank is not None:
        args, kwargs = cut(args, kwargs, keys, heads, rank, tp)
        index = {key: _heads_of(i, key[2], heads, rank, tp) for key, i in index.items()}
    return args, kwargs, {id(_get(args, kwargs, key)): (name(key), i) for key, i in index.items()}


def name(key: Key) -> str:
    """How the block trace names the elements of the input ``key``."""
    return f"<input {key[1]}>"


def in_words(key: Key) -> str:
    """The input ``key`` in words: its keyword, or its place among the block's positional arguments."""
    kind, where, _ = key
    return where if kind == "kwarg" else f"argument {where}"


def _heads_of(x: Tensor, dim: int, heads: int, rank: int, tp: int) -> Tensor:
    groups, per_rank = x.shape[dim] // heads, heads // tp
    return x.unflatten(dim, (groups, heads)).narrow(dim + 1, rank * per_rank, per_rank).flatten(dim, dim + 1)


def _changed(args: tuple, kwargs: dict, keys: list[Key], change) -> tuple[tuple, dict]:
    args, kwargs = list(args), dict(kwargs)
    for kind, where, dim in keys:
        holder = args if kind == "arg" else kwargs
        holder[where] = change(holder[where], dim)
    return tuple(args), kwargs


def _get(args: tuple, kwargs: dict, key: Key) -> Any:
    kind, where = key[:2]
    if kind == "arg":
        return args[where] if where < len(args) else None
    return kwargs.get(where)


class HeadInputs(ParallelStyle):
    """Cuts the block inputs ``keys`` to this tp rank's ``heads``; ``inner``: the block's other style
    (its hidden states' layout under sequence parallelism), applied first.

    Example (BLOOM, 4 heads, its ALiBi bias (batch x heads, 1, tokens); CPM-Ant's (batch, heads, q, k))::

        {"model.transformer.h.*": HeadInputs([("kwarg", "alibi", 0)], heads=4)}
        {"model.cpmant.encoder.layers.*": HeadInputs([("arg", 2, 1)], heads=4)}
    """

    def __init__(self, keys: list[Key], heads: int, inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.keys, self.heads, self.inner = list(keys), heads, inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        rank, tp = device_mesh.get_local_rank(), device_mesh.size()

        def hook(_module, args, kwargs):  # the inputs this call passes
            keys = [key for key in self.keys if _get(args, kwargs, key) is not None]
            # each rank's gradient of a cut input is its heads' share
            args, kwargs = _changed(args, kwargs, keys, lambda x, _: gradient_summed(x, device_mesh)
                                    if x.requires_grad else x)
            return cut(args, kwargs, keys, self.heads, rank, tp)

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"HeadInputs({self.keys}, heads={self.heads}" + (f", inner={self.inner!r})" if self.inner else ")")
