"""Values for the meta tensors a model's forward reads, so that it runs on the meta device end to end.

A forward on the meta device computes shapes, not values; code that reads a value fails there
(``Tensor.item() cannot be called on meta tensors``). transformers' mask code does so in a training set-up:
without a key/value cache it checks whether the position ids pack several sequences into one row, and before
skipping the causal mask it asks whether the padding mask is all ones.

:class:`MetaValues` keeps a host twin beside every small meta tensor that derives from the inputs and from
constants alone (token ids, masks, positions, ``arange``): each op on tensors that all have twins runs again on
the twins. Where the forward reads a value, the twin gives it. Tensors that derive from weights (on meta, with
no values) get no twin; reading one still fails, as it must: such a forward depends on the weights' values.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

MAX_TWIN_ELEMENTS = 1 << 16
"""The largest tensor given a twin: ids, masks and positions of a short sequence are far below it; a larger
tensor derived from them (a dense 4D mask of a long sequence) is not worth its host memory here."""

_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}
"""The ops that hand a tensor's value to Python (``.item()``, ``bool(t)``, ``if t:``)."""


class MetaValues(TorchDispatchMode):
    """Inside it, meta tensors made from ``inputs`` (meta tensors paired with their host values) and from
    constants carry host twins, and their values can be read.

    Example::

        ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
        with MetaValues({ids: torch.zeros(1, 4, dtype=torch.long)}):
            model(ids)  # the mask code's `.all()` reads the twin's value
    """

    def __init__(self, inputs: dict[Tensor, Tensor] | None = None) -> None:
        super().__init__()
        self.twins: dict[int, Tensor] = {}
        self.keep: list[Tensor] = []  # twinned meta tensors stay alive: their ids are the keys
        for meta, value in (inputs or {}).items():
            self._pair(meta, value)

    def _pair(self, meta: Tensor, value: Tensor) -> None:
        self.twins[id(meta)] = value
        self.keep.append(meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        if func in _READS and flat and flat[0].device.type == "meta" and id(flat[0]) in self.twins:
            return func(self.twins[id(flat[0])])
        out = func(*args, **kwargs)
        metas = [a for a in flat if a.device.type == "meta"]
        if not metas and flat:
            return out  # the twins' own work on the host
        known = all(id(a) in self.twins for a in metas)
        if known:
            host_args, host_kwargs = tree_map(self._host, args), tree_map(self._host, kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]
        for o in outs:  # an in-place op changes its input: its old value goes, whatever replaces it
            self.twins.pop(id(o), None)
        if not known or not outs or any(o.device.type != "meta" or o.numel() > MAX_TWIN_ELEMENTS for o in outs):
            return out  # a weight's descendant (no values), or too large to mirror
        try:
            host = func(*host_args, **host_kwargs)
        except Exception:  # noqa: BLE001 -- an op the host cannot mirror: its outputs go without values
            return out
        pieces = [h for h in tree_flatten(host)[0] if isinstance(h, Tensor)]
        if len(pieces) == len(outs):
            for meta, value in zip(outs, pieces):
                if tuple(meta.shape) == tuple(value.shape):
                    self._pair(meta, value)
        return out

    def _host(self, x):
        if isinstance(x, Tensor):
            return self.twins[id(x)] if x.device.type == "meta" else x
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")  # a factory op (arange, ones) made on meta: its twin on the host
        return x
