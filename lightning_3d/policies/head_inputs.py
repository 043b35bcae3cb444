"""A block's inputs with one slice per attention head, cut to this tp rank's heads.

Some models compute a per-head tensor once, outside the blocks, and hand it to every block: BLOOM's ALiBi
bias, ``(batch x heads, 1, tokens)``; MPT's, ``(heads, 1, tokens)``. At tp, rank r computes heads
``[r H/tp, (r+1) H/tp)``, so its blocks must get those heads' slices: :class:`HeadInputs` cuts them on the way
into the block (a forward pre-hook), as :func:`cut` cuts them for the shrunk block's trace that found them
(:mod:`~lightning_3d.policies.tp_structure`). The leading dimension is read as (groups, heads): one group, or
the batch.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

Key = tuple[str, Any]
"""Where an input is: ("arg", position) or ("kwarg", name)."""


def candidates(args: tuple, kwargs: dict, heads: int) -> list[Key]:
    """The block's tensor inputs, besides the hidden states (the first), whose leading dimension holds a
    whole number of times the heads."""
    keys = [("arg", i) for i in range(len(args))] + [("kwarg", name) for name in kwargs]
    tensors = [(key, _get(args, kwargs, key)) for key in keys]
    tensors = [(key, t) for key, t in tensors if isinstance(t, Tensor)][1:]
    return [key for key, t in tensors if t.dim() >= 1 and t.shape[0] >= heads and t.shape[0] % heads == 0]


def cut(args: tuple, kwargs: dict, keys: list[Key], heads: int, rank: int, tp: int) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` with each input of ``keys`` cut to tp rank ``rank``'s heads."""
    args, kwargs = list(args), dict(kwargs)
    for kind, where in keys:
        holder = args if kind == "arg" else kwargs
        holder[where] = _heads_of(holder[where], heads, rank, tp)
    return tuple(args), kwargs


def _heads_of(x: Tensor, heads: int, rank: int, tp: int) -> Tensor:
    groups, per_rank = x.shape[0] // heads, heads // tp
    mine = x.reshape(groups, heads, *x.shape[1:])[:, rank * per_rank:(rank + 1) * per_rank]
    return mine.reshape(groups * per_rank, *x.shape[1:])


def _get(args: tuple, kwargs: dict, key: Key) -> Any:
    kind, where = key
    return args[where] if kind == "arg" else kwargs[where]


class HeadInputs(ParallelStyle):
    """Cuts the block inputs ``keys`` to this tp rank's ``heads``; ``inner``: the block's other style
    (its hidden states' layout under sequence parallelism), applied first.

    Example (BLOOM, 4 heads)::

        {"model.transformer.h.*": HeadInputs([("kwarg", "alibi")], heads=4)}
    """

    def __init__(self, keys: list[Key], heads: int, inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.keys, self.heads, self.inner = list(keys), heads, inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        rank, tp = device_mesh.get_local_rank(), device_mesh.size()

        def hook(_module, args, kwargs):  # the inputs this call passes
            keys = [(kind, where) for kind, where in self.keys
                    if (where in kwargs if kind == "kwarg" else where < len(args))]
            return cut(args, kwargs, keys, self.heads, rank, tp)

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"HeadInputs({self.keys}, heads={self.heads}" + (f", inner={self.inner!r})" if self.inner else ")")
