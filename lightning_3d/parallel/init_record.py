"""Proof that a meta-device build can be initialized by replay: watch the construction, then judge.

Replaying ``reset_parameters()`` (``lightning_3d.parallel.weight_init.replay_init``) gives the weights an eager
build gives only if the model initializes itself that way. Many do not: nanoGPT re-initializes every
``Linear`` from the root (``self.apply(self._init_weights)``) and scales its residual projections, Hugging
Face models run ``post_init()``, a module may keep a tensor made by ``torch.ones`` and never touch it again.
Replaying those would silently start from other weights.

:class:`ConstructionRecord` is a ``TorchFunctionMode`` active while the model is built on the meta device
(nothing is computed there, so watching costs little). It notes every torch call that writes a tensor in
place or draws random numbers, and the innermost ``reset_parameters()`` it ran in. :meth:`verdict` then
says whether the replay is equivalent, and if not, why, naming the tensor and the line of code:

* every random draw and every write to a parameter or buffer happened inside ``reset_parameters()`` of the
  module that owns the tensor (so replaying the resets redraws exactly what was drawn, in the same order);
* a reset read no other module's tensor (at replay those are still on the meta device), and no reset ran
  inside another module's reset between that one's own draws (replay runs each reset as one unit);
* every parameter and buffer got its value in its owner's reset (or, for modules without one, from the
  policy's ``init_module``): one made by ``torch.ones(...)`` in ``__init__`` and never written has no
  reset to replay;
* each reset that drew random numbers belongs to a module of the final model.

What cannot be watched is construction that runs otherwise on the meta device than on the host: Hugging
Face models skip their ``post_init()`` init there, so they are never judged replayable (unless their
parameters are loaded from a file next). Code of one's own that tests ``is_meta`` to skip its init would
escape the check; the meta route's docs say so (``lightning_3d.parallel.weight_init``).

:meth:`reset_order` gives the resets in the order construction ran them, for the replay to follow.
:class:`ModuleAttributes` lets the strategy run ``configure_model()`` again, on the host, when it is not.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_3d.common import parent_fqn

# Calls that draw from the generator: the in-place samplers of Tensor and of torch.nn.init (which reach the
# mode under their own names) and torch's sampling functions.
RANDOM_CALLS = frozenset({
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_",
    "sparse_", "randn", "rand", "randint", "randperm", "randn_like", "rand_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson", "dropout",
})
# In-place methods (trailing underscore) that change no values.
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
_TORCH_DIR = os.path.dirname(torch.__file__)


class ConstructionRecord(TorchFunctionMode):
    """Enter around the meta-device build; then :meth:`verdict` and :meth:`reset_order` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[_Event] = []
        self._keep: list[Any] = []  # tensors and frames seen: kept alive so their ids stay unique

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        random = name in RANDOM_CALLS
        target = _written(name, args, kwargs)
        if random or target is not None:
            frame, module = _innermost_reset()
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            self._keep += [frame, *tensors]
            self.events.append(_Event(name, random, None if target is None else storage_key(target),
                                      {storage_key(t) for t in tensors}, id(frame) if frame else None, module,
                                      _user_line()))
        return func(*args, **kwargs)

    def verdict(self, model: nn.Module, init_module: Callable | None = None, params_loaded: bool = False) -> str | None:
        """None if replaying the resets of ``model`` gives the weights this construction gave; else why not.

        ``init_module``: the policy's init for modules without ``reset_parameters()``. ``params_loaded``:
        parameters come from a file next (``init_from``), so only buffers must be replayable."""
        if not params_loaded:
            skipped = _init_skipped_on_meta(model)
            if skipped is not None:
                return skipped
        owners = _owners(model)
        names = {id(m): fqn or "<root>" for fqn, m in model.named_modules(remove_duplicate=False)}
        watched = {key for key, (_, is_buffer) in owners.items() if is_buffer or not params_loaded}
        written: set[int] = set()
        own_keys: dict[int, set[int]] = {}  # module id -> its own tensors' storage keys (computed once)
        for event in self.events:
            if event.module is None:
                if event.random and not params_loaded:
                    return f"{event.where} draws random numbers ({event.call}) outside any reset_parameters()"
                if event.target in watched:
                    return (f"{owners[event.target][0]} is written by {event.where} ({event.call}) outside"
                            f" reset_parameters()")
                continue
            own = own_keys.get(id(event.module))
            if own is None:
                own = own_keys[id(event.module)] = {storage_key(t) for t in _own_tensors(event.module).values()}
            foreign = sorted(owners[k][0] for k in event.tensors - own if k in owners)
            if foreign:
                return (f"reset_parameters() of {names.get(id(event.module), type(event.module).__name__)} uses"
                        f" {foreign[0]} at {event.where}, a tensor of another module")
            if event.random and id(event.module) not in names and not params_loaded:
                return (f"a {type(event.module).__name__} built during construction but not part of the model"
                        f" draws random numbers at {event.where}")
            if event.target in own:
                written.add(event.target)
        interleaved = self._interleaved()
        if interleaved is not None:
            return f"reset_parameters() of {names.get(id(interleaved), type(interleaved).__name__)} runs another" \
                   " module's reset_parameters() between its own draws"
        for key in sorted(watched - written, key=lambda k: owners[k][0]):
            fqn, is_buffer = owners[key]
            module = model.get_submodule(parent_fqn(fqn))
            # The policy's init_module gives a value to a buffer (rotary frequencies) or, when the parameters
            # are loaded next, to the modules without reset_parameters(); a parameter drawn at random is not
            # proven to be drawn as construction drew it.
            if (is_buffer or params_loaded) and init_module is not None and not callable(
                    getattr(module, "reset_parameters", None)):
                continue
            return (f"{fqn} gets its value when it is created, not in reset_parameters(), which replay would"
                    " call")
        return None

    def reset_order(self, model: nn.Module) -> list[str]:
        """FQNs of the modules whose ``reset_parameters()`` construction ran, in that order (a module reset
        twice appears twice); modules not in ``model`` are left out."""
        names = {id(m): fqn for fqn, m in model.named_modules(remove_duplicate=False)}
        order: list[str] = []
        last = None
        for event in self.events:
            if event.invocation is not None and event.invocation != last and id(event.module) in names:
                order.append(names[id(event.module)])
            last = event.invocation if event.invocation is not None else last
        return order

    def _interleaved(self) -> nn.Module | None:
        """A module whose reset invocation is split by another reset's events (nested resets), if any."""
        seen, last = set(), None
        for event in self.events:
            if event.invocation is None or event.invocation == last:
                continue
            if event.invocation in seen:
                return event.module
            seen.add(event.invocation)
            last = event.invocation
        return None


class _Event:
    __slots__ = ("call", "random", "target", "tensors", "invocation", "module", "where")

    def __init__(self, call, random, target, tensors, invocation, module, where) -> None:
        self.call, self.random, self.target, self.tensors = call, random, target, tensors
        self.invocation, self.module, self.where = invocation, module, where


def _init_skipped_on_meta(model: nn.Module) -> str | None:
    """Construction that behaves otherwise on the meta device cannot be watched there. Hugging Face models
    do: ``PreTrainedModel.init_weights()`` skips their init (``post_init``) when built on meta."""
    for fqn, module in model.named_modules():
        if callable(getattr(module, "post_init", None)) and callable(getattr(module, "_init_weights", None)):
            return (f"{fqn} ({type(module).__name__}) is a Hugging Face model, whose post_init() initializes it and"
                    " is skipped on the meta device")
    return None


def _written(name: str, args: tuple, kwargs: dict) -> Tensor | None:
    """The tensor a call writes in place (``x.normal_()``, ``init.zeros_(x)``, ``x[i] = v``, ``x.data = v``,
    ``out=x``), or None."""
    if isinstance(kwargs.get("out"), Tensor):
        return kwargs["out"]
    in_place = name.endswith("_") and not name.startswith("_") and name not in NOT_WRITES
    if not (in_place or name in ("__setitem__", "__set__")):
        return None
    # torch.nn.init hands its tensor over by keyword (``tensor=``) when a mode is active.
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    return first if isinstance(first, Tensor) else None


def storage_key(tensor: Tensor) -> int:
    """One key per storage: a parameter, its ``.data`` and its views share it (also on the meta device)."""
    return tensor.untyped_storage()._cdata


def _innermost_reset():
    """(frame, module) of the innermost ``reset_parameters`` running now, or (None, None)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "reset_parameters":
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                return frame, module
        frame = frame.f_back
    return None, None


def _user_line() -> str:
    """``file:line in function`` of the innermost caller outside torch and this file (for messages)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            return f"{os.path.relpath(path) if not path.startswith('<') else path}:{frame.f_lineno} in" \
                   f" {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def _own_tensors(module: nn.Module) -> dict[str, Tensor]:
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _owners(model: nn.Module) -> dict[int, tuple[str, bool]]:
    """Storage key -> (FQN, is a buffer) of every parameter and buffer of ``model`` on the meta device (the
    ones replay initializes; tensors built before, in ``__init__``, are real already)."""
    owners = {storage_key(p): (fqn, False) for fqn, p in model.named_parameters() if p.is_meta}
    owners.update({storage_key(b): (fqn, True) for fqn, b in model.named_buffers() if b.is_meta})
    return owners


class ModuleAttributes:
    """What a module holds before ``configure_model()`` builds into it, to run that hook again from there.

    ``restore`` drops the submodules, parameters, buffers and attributes the hook added and puts back those
    it replaced (e.g. ``self.model = None`` in ``__init__``), so a hook that builds once (``if self.model is
    None``) builds again. Attributes the hook changed in place are not tracked."""

    _REGISTRIES = ("_modules", "_parameters", "_buffers")

    def __init__(self, module: nn.Module) -> None:
        self._attributes = {k: v for k, v in vars(module).items() if k not in self._REGISTRIES}
        self._registries = {name: dict(getattr(module, name)) for name in self._REGISTRIES}

    def restore(self, module: nn.Module) -> None:
        for name, before in self._registries.items():
            registry = getattr(module, name)
            registry.clear()
            registry.update(before)
        attributes = vars(module)
        for key in [k for k in attributes if k not in self._attributes and k not in self._REGISTRIES]:
            del attributes[key]
        for key, value in self._attributes.items():
            attributes.setdefault(key, value)
