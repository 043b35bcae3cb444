"""Does an attention module still attend over whole heads once "auto" has split it over tp? Checked on meta.

"auto" splits q, k and v column-wise and divides the head counts it knows by name (``HEAD_ATTRIBUTES``). A
module that reshapes by a count under another name (``self.heads``) with ``view(B, T, self.heads, -1)``
then runs without any error on each rank -- with heads of ``head_dim / tp`` values and the wrong softmax
scale: silently other numbers than one process. Here, once per attention class, the module runs twice on the
meta device (no memory, no data, no random numbers): as it is, and as one tp rank holds it (q/k/v with
``out_features / tp``, the output projection with ``in_features / tp``, the attribute fixes applied). In
both runs every attention product is recorded -- the width each one contracts over, which the split must
not change (``scaled_dot_product_attention``'s head dimension, ``q @ k.T``'s and ``attn @ v``'s inner
sizes). A difference is refused, naming the module, the sizes and the integer attributes it holds.

Modules whose forward needs more than the hidden states (a mask, rotary tables) cannot be run without
their inputs, and are not checked (the tp shape check at the first call still sees their shape errors).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_3d.errors import LayoutError

_PRODUCTS: dict[Callable, Callable[[tuple, dict], int]] = {
    F.scaled_dot_product_attention: lambda args, kwargs: args[0].shape[-1],
    torch.matmul: lambda args, kwargs: args[0].shape[-1],
    Tensor.matmul: lambda args, kwargs: args[0].shape[-1],
    Tensor.__matmul__: lambda args, kwargs: args[0].shape[-1],
    torch.bmm: lambda args, kwargs: args[0].shape[-1],
    Tensor.bmm: lambda args, kwargs: args[0].shape[-1],
}
"""The attention products and the size each contracts over (``F.linear``, the projections, is not one)."""


class _Contractions(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            self.sizes.append((getattr(func, "__name__", str(func)), int(_PRODUCTS[func](args, kwargs))))
        return func(*args, **kwargs)


def check_heads_stay_whole(attention: nn.Module, fqn: str, styles: dict[str, Any], fixes: dict[str, int],
                           tp: int) -> None:
    """Raise :class:`LayoutError` if ``attention`` (at ``fqn``), split by ``styles`` (child name -> style:
    column-wise children lose ``out_features``, the row-wise one ``in_features``) with ``fixes`` set on it,
    attends over other widths than the whole module."""
    if not _takes_hidden_states_only(attention):
        return
    width = next(child.in_features for name, child in attention.named_children() if name in styles)
    whole, local = _meta_copy(attention), _meta_copy(attention)
    for name, style in styles.items():
        _shrink(getattr(local, name), tp, rows=type(style).__name__ == "ColwiseParallel")
    for name, value in fixes.items():
        setattr(local, name, value)
    whole_sizes, local_sizes = _contractions(whole, width), _contractions(local, width)
    if whole_sizes is None or local_sizes is None or whole_sizes == local_sizes:
        return
    ints = {name: value for name, value in vars(attention).items() if type(value) is int}
    changed = "; ".join(f"{op} over {a} -> {b}" for (op, a), (_, b) in zip(whole_sizes, local_sizes) if a != b)
    raise LayoutError(
        f"policy='auto' splits {fqn} ({type(attention).__name__}) over tensor_parallel_size={tp}, but its forward"
        f" would then attend over other widths than one process: {changed or 'other products'}. It reshapes by a"
        f" head count auto does not know by name (its integer attributes: {ints}; auto divides {sorted(fixes)})."
        " Rename the head count to one auto knows (num_heads, n_head, ...: policies.auto.HEAD_ATTRIBUTES), or"
        " register a policy whose attribute_fixes give it per rank.")


def _takes_hidden_states_only(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in parameters if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def _meta_copy(module: nn.Module) -> nn.Module:
    memo = {id(t): _like_on_meta(t, t.shape) for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


def _like_on_meta(tensor: Tensor, shape) -> Tensor:
    meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def _shrink(linear: nn.Linear, tp: int, rows: bool) -> None:
    """What one tp rank holds of ``linear``: its output rows (column-wise) or input columns (row-wise)."""
    out_features, in_features = linear.weight.shape
    shape = (out_features // tp, in_features) if rows else (out_features, in_features // tp)
    linear.weight = _like_on_meta(linear.weight, shape)
    if rows and linear.bias is not None:
        linear.bias = _like_on_meta(linear.bias, (out_features // tp,))
    linear.out_features, linear.in_features = shape


def _contractions(module: nn.Module, width: int) -> list[tuple[str, int]] | None:
    """The contraction sizes of the attention products one forward on meta computes; None if it fails."""
    record = _Contractions()
    hidden = torch.empty(1, 4, width, device="meta", dtype=next(module.parameters()).dtype)
    try:
        with torch.no_grad(), record:
            module(hidden)
    except Exception:  # noqa: BLE001 -- a forward that meta cannot run (data-dependent code) is not checked
        return None
    return record.sizes
