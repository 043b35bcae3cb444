"""Which tensors of a forward tensor parallelism would divide over its ranks, followed op by op.

Under a policy's plan a column-parallel layer leaves each tp rank its share of the output features, and
everything computed from that share (attention over the rank's heads, the MLP's activation) stays a share
until a row-parallel layer reduces it to whole again. :class:`SplitTracker` follows that through one forward
of the unsplit model: a column-parallel module's output is split, an op with a split input makes split
outputs, a row-parallel module's output is whole. ``strategies/measure_model.py`` asks it, for each tensor
saved for backward, whether tensor parallelism divides it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class SplitTracker(TorchDispatchMode):
    """A dispatch mode that marks the storages tensor parallelism would split (see the module docstring).

    Example::

        tracker = SplitTracker()
        handles = tracker.watch(model, columns={"mlp.up"}, rows={"mlp.down"})
        with tracker:
            out = model(x)
        tracker.is_split(StorageWeakRef(t.untyped_storage()))
    """

    def __init__(self) -> None:
        super().__init__()
        self._split: dict[StorageWeakRef, Tensor] = {}
        """Split storages, each with a tensor that holds it (a storage freed during the forward could lend its key
        to a later one)."""

    def watch(self, module: nn.Module, columns: set[str], rows: set[str]) -> list[Any]:
        """Hooks on ``module``'s submodules named in ``columns`` (their output split) and ``rows`` (their output
        whole); the handles, to remove when done."""
        handles = []
        for fqn in columns:
            handles.append(module.get_submodule(fqn).register_forward_hook(lambda _m, _a, out: self._mark(out, True)))
        for fqn in rows:
            handles.append(module.get_submodule(fqn).register_forward_hook(lambda _m, _a, out: self._mark(out, False)))
        return handles

    def is_split(self, key: StorageWeakRef) -> bool:
        return key in self._split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, Tensor) and StorageWeakRef(t.untyped_storage()) in self._split
               for t in tree_flatten((args, kwargs))[0]):
            self._mark(out, True)
        return out

    def _mark(self, values: Any, split: bool) -> None:
        for tensor in tree_flatten(values)[0]:
            if isinstance(tensor, Tensor):
                key = StorageWeakRef(tensor.untyped_storage())
                if split:
                    self._split[key] = tensor
                else:
                    self._split.pop(key, None)
