"""Values for the meta tensors a model's forward reads, so that it runs on the meta device end to end.

A forward on the meta device computes shapes, not values; code that reads a value fails there
(``Tensor.item() cannot be called on meta tensors``). transformers' mask code does so in a training set-up:
without a key/value cache it checks whether the position ids pack several sequences into one row, and before
skipping the causal mask it asks whether the padding mask is all ones.

:class:`MetaValues` keeps a host twin beside every small meta tensor that derives from the inputs and from
constants alone (token ids, masks, positions, ``arange``): each op on tensors that all have twins runs again on
the twins. Where the forward reads a value, the twin gives it. Tensors that derive from weights (on meta, with
no values) get no twin; reading one fails, as it must: such a forward depends on the weights' values. Two kinds
of value get twins all the same:

* tensors made from Python data (``torch.tensor(0.5)``, a distribution's parameters): their twin is that data;
* the indices an op chooses by comparing values (``topk``, ``sort``, ``argmax``): a router's choice of experts,
  which a mixture of experts counts and splits its tokens by. On meta that choice has no values to go by; the
  twin is the choice made on stand-in values (a fixed draw), a valid routing with the shapes of any other.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

MAX_TWIN_ELEMENTS = 1 << 16
"""The largest tensor given a twin: ids, masks and positions of a short sequence are far below it; a larger
tensor derived from them (a dense 4D mask of a long sequence) is not worth its host memory here."""

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
"""The ops that hand a tensor's value to Python (``.item()``, ``bool(t)``, ``if t:``)."""
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
"""The constructors of a tensor from Python data (numbers, lists), which no dispatch mode sees."""
_CHOICES = {aten.topk.default, aten.sort.default, aten.sort.stable, aten.argmax.default, aten.argmin.default,
            aten.max.dim, aten.min.dim, aten.kthvalue.default}
"""Ops that choose positions by comparing values: their integer outputs (indices) are choices."""


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
        self.from_data = _FromData(self)
        self.stand_ins = torch.Generator().manual_seed(0)  # the values choices are made on (not the global stream)
        for meta, value in (inputs or {}).items():
            self._pair(meta, value)

    def __enter__(self):
        self.from_data.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.from_data.__exit__(*exc)

    def _pair(self, meta: Tensor, value: Tensor) -> None:
        self.twins[id(meta)] = value
        self.keep.append(meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        metas = [a for a in flat if a.device.type == "meta"]
        known = all(id(a) in self.twins for a in metas)
        if metas and (func in _READS or _to_host(func, kwargs)):
            if not known:
                raise RuntimeError("the forward reads a value (.item(), .tolist(), if t:) the meta device does not"
                                   " hold: it derives from the weights (or from a tensor too large to mirror)")
            return func(*tree_map(self._host, args), **kwargs)  # `.item()`, `.tolist()`: the twin's value
        out = func(*args, **kwargs)
        if not metas and flat:
            return out  # the twins' own work on the host
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]
        for o in outs:  # an in-place op changes its input: its old value goes, whatever replaces it
            self.twins.pop(id(o), None)
        chosen = not known and func in _CHOICES
        if (not known and not chosen) or not outs or any(
                o.device.type != "meta" or o.numel() > MAX_TWIN_ELEMENTS for o in outs):
            return out  # a weight's descendant (no values), or too large to mirror
        try:
            host = func(*tree_map(self._stand_in if chosen else self._host, args), **tree_map(self._host, kwargs))
        except Exception:  # noqa: BLE001 -- an op the host cannot mirror: its outputs go without values
            return out
        pieces = [h for h in tree_flatten(host)[0] if isinstance(h, Tensor)]
        if len(pieces) == len(outs):
            for meta, value in zip(outs, pieces):
                if tuple(meta.shape) == tuple(value.shape) and not (chosen and value.is_floating_point()):
                    self._pair(meta, value)  # of a choice, the indices alone: the values chosen stay unknown
        return out

    def _stand_in(self, x):
        if isinstance(x, Tensor) and x.device.type == "meta" and id(x) not in self.twins:
            return torch.rand(x.shape, generator=self.stand_ins).to(x.dtype)
        return self._host(x)

    def _host(self, x):
        if isinstance(x, Tensor):
            return self.twins[id(x)] if x.device.type == "meta" else x
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")  # a factory op (arange, ones) made on meta: its twin on the host
        return x


def _to_host(func, kwargs) -> bool:
    """A copy off the meta device (``.tolist()``, ``.cpu()``)."""
    device = kwargs.get("device")
    return func is aten._to_copy.default and device is not None and torch.device(device).type != "meta"


class _FromData(TorchFunctionMode):
    """Pairs a meta tensor made from Python data with the same data on the host."""

    def __init__(self, values: MetaValues) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = isinstance(out, Tensor) and out.device.type == "meta" and out.numel() <= MAX_TWIN_ELEMENTS
        if func in _FROM_DATA and made:
            try:
                self.values._pair(out, func(*tree_map(self.values._host, args), **{**kwargs, "device": "cpu"}))
            except Exception:  # noqa: BLE001 -- data that is itself a meta tensor without values
                pass
        return out
