"""What holds the place of a module another pipeline stage runs, in a stage that runs the model's forward as
written (``pipeline.as_written``). Neither holds parameters; both learn what the module would return from a
copy of it on the meta device (no memory, no values).

* :class:`PassThroughBlock`, for a block: returns its first input, in the structure the block returns (or,
  where the previous stage ends, what that stage sent);
* :class:`Shell`, for an embedding or the head: returns zeros of the shape the module returns.

Their values are placeholders: ``pipeline.placeholder_watch`` checks that a stage's output owes nothing to them.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten
from torch.utils.hooks import RemovableHandle


class Placeholder(nn.Module):
    """What :class:`PassThroughBlock` and :class:`Shell` share: a meta-device copy of the module they stand for
    (not a submodule: this stage holds none of its parameters), through which the forward may read the
    module's attributes (``embed.weight.device``, ``layer.attention_type``): its parameters and buffers read as
    zeros of their shape on this stage's device (one element, expanded), its other attributes as the module
    has them. What the forward computes from those zeros must not reach the stage's output
    (``pipeline.placeholder_watch``, which :meth:`watch_reads` tells of each read)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "meta_module", meta_copy(module))
        # Follows the stage's moves and casts (``.to(device)``, a precision's ``.to(dtype)``): the device and
        # floating dtype of the zeros that stand for the module's parameters.
        floating = [t.dtype for t in module.parameters() if t.is_floating_point()]
        object.__setattr__(self, "probe", torch.empty(0, dtype=floating[0] if floating else torch.float32))
        object.__setattr__(self, "readers", OrderedDict())  # (RemovableHandle keeps a weak reference)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("meta_module")
            if meta is None:
                raise
        tensor = dict([*meta.named_parameters(recurse=False), *meta.named_buffers(recurse=False)]).get(name)
        if tensor is not None:
            probe = self.__dict__["probe"]
            dtype = probe.dtype if tensor.is_floating_point() else tensor.dtype
            zeros = torch.zeros((), dtype=dtype, device=probe.device).expand(tensor.shape)
            for reader in list(self.__dict__["readers"].values()):
                reader(zeros)
            return zeros
        value = getattr(meta, name)
        if isinstance(value, nn.Module):
            raise AttributeError(f"{name!r} is a submodule of {type(meta).__name__}, which another pipeline stage"
                                 f" holds; a placeholder ({type(self).__name__}) stands for it on this stage")
        return value

    def watch_reads(self, reader: Callable[[Tensor], None]) -> RemovableHandle:
        """Call ``reader`` with each placeholder tensor the forward reads as a parameter or buffer."""
        handle = RemovableHandle(self.__dict__["readers"])
        self.__dict__["readers"][handle.id] = reader
        return handle

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Placeholder:
        object.__setattr__(self, "probe", fn(self.__dict__["probe"]))
        return self


class PassThroughBlock(Placeholder):
    """Holds the place of a block another stage runs: returns its first input where the block returns its
    output activation -- the block's first tensor -- in the structure the block returns: a block that returns
    ``(hidden, attn_weights)`` gives ``(input, None)``, so that the forward's ``hidden = block(hidden)[0]``
    reads the activation. The structure is worked out on the meta-device copy of the block, once per signature
    of the inputs (their shapes and dtypes, the other arguments' types); the block's other tensors are zeros
    of their shape. Where the copy cannot run on meta, the input is returned as it is.

    The block where the previous stage ends returns, once, what that stage sent instead (:meth:`hand_over`):
    its activation and whatever other tensors the block returned (indices one block passes the next)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__(block)
        object.__setattr__(self, "templates", {})  # input signature -> the block's output, without its values
        object.__setattr__(self, "handed", None)

    def hand_over(self, tensors: tuple[Tensor, ...]) -> None:
        """The next call returns ``tensors`` (the previous stage's, in the order the block returns its own)."""
        object.__setattr__(self, "handed", tensors)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        handed = self.handed
        object.__setattr__(self, "handed", None)
        template = self._template(args, kwargs)
        if handed is not None:
            return _handed_over(template, handed, type(self.meta_module).__name__)
        first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, Tensor))
        if template is None:
            return first
        spec, outputs = template
        index = next(i for i, x in enumerate(outputs) if isinstance(x, Tensor))
        filled = [first if i == index else torch.zeros(x.shape, dtype=x.dtype, device=first.device)
                  if isinstance(x, Tensor) else x for i, x in enumerate(outputs)]
        return tree_unflatten(filled, spec)

    def _template(self, args: tuple, kwargs: dict) -> tuple[TreeSpec, list] | None:
        leaves, spec = tree_flatten((args, kwargs))
        key = (spec, tuple((x.shape, x.dtype) if isinstance(x, Tensor) else _signature(x) for x in leaves))
        if key not in self.templates:
            self.templates[key] = _output_template(self.meta_module, args, kwargs)
        return self.templates[key]


def _signature(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else type(value)


def _output_template(block: nn.Module, args: tuple, kwargs: dict) -> tuple[TreeSpec, list] | None:
    """What ``block`` returns for these inputs: its structure and its leaves (tensors on meta); None where the
    block cannot run on meta, or returns a bare tensor or no tensor."""
    on_meta = tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x, (args, kwargs))
    try:
        with torch.no_grad(), torch.device("meta"):
            output = block(*on_meta[0], **on_meta[1])
    except Exception:  # noqa: BLE001 -- a block meta cannot run: the input is returned as it is
        return None
    leaves, spec = tree_flatten(output)
    if spec.is_leaf() or not any(isinstance(x, Tensor) for x in leaves):
        return None
    return spec, leaves


def _handed_over(template: tuple[TreeSpec, list] | None, tensors: tuple[Tensor, ...], block: str) -> Any:
    """``tensors`` in the block's output structure: its tensors' places, in order."""
    if template is None:
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
    spec, outputs = template
    places = [i for i, x in enumerate(outputs) if isinstance(x, Tensor)]
    if len(places) != len(tensors):
        raise RuntimeError(f"The previous pipeline stage sent {len(tensors)} tensors from its last {block}, which"
                           f" returns {len(places)} here: a block must return the same tensors on every stage.")
    filled = dict(zip(places, tensors))
    return tree_unflatten([filled.get(i, x) for i, x in enumerate(outputs)], spec)


class Shell(Placeholder):
    """Holds the place of a module (an embedding, the head) another stage runs: returns zeros of the shape
    and dtype that module would return, worked out on the meta-device copy."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        devices = [x.device for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
        device = devices[0] if devices else torch.device("cpu")
        on_meta = tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x, (args, kwargs))
        with torch.no_grad():
            output = self.meta_module(*on_meta[0], **on_meta[1])
        return tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype, device=device) if isinstance(x, Tensor)
                        else x, output)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (nothing allocated)."""
    memo = {id(t): _on_meta(t) for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


def _on_meta(tensor: Tensor) -> Tensor:
    meta = torch.empty_like(tensor, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
