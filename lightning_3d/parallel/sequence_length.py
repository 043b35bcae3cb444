"""Sequence parallelism splits every sequence over the tp ranks: a length tp does not divide is refused at the
model call, on every rank alike, before the call's first collective.

Why refuse rather than split unevenly: the activations between regions travel as local shards of the
sequence (``use_local_output``), which DTensor rebuilds as if every rank held the same length; with 31
positions over 2 ranks gloo then stops with "Received data size doesn't match expected size (8192 vs 7680)"
and NCCL, which does not check sizes, would hang or compute on garbage. Megatron-LM, too, requires the
sequence length to be a multiple of tp under sequence parallelism; padding is the user's to choose (it
changes what the loss sees unless masked).

What is checked: the model call's tensor inputs of 2 or 3 dimensions -- token ids and masks ``(B, T)``,
embeddings ``(B, T, C)`` -- along dimension 1, the one the plans shard (``Shard(1)``). A 4-d attention mask
or a 1-d position vector is left alone.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor, nn

from lightning_3d.common import parent_fqn
from lightning_3d.errors import LayoutError


def check_sequence_length(args: tuple, kwargs: dict, tp: int, model: str = "the model") -> None:
    """Raise :class:`LayoutError` if a sequence input of the call ``model(*args, **kwargs)`` has a length that
    ``tp`` does not divide."""
    named = [(f"input {i}", x) for i, x in enumerate(args)] + list(kwargs.items())
    for name, x in named:
        if isinstance(x, Tensor) and x.dim() in (2, 3) and x.shape[1] % tp:
            length = x.shape[1]
            padded = -(-length // tp) * tp
            raise LayoutError(
                f"sequence_parallel=True splits each sequence over tensor_parallel_size={tp} ranks, but {model}"
                f" was called with {name} of shape {tuple(x.shape)}: {length} positions, which {tp} does not"
                f" divide. Pad the sequences to a multiple of {tp} ({padded}; leave the padding out of the loss),"
                " or set sequence_parallel=False.")


def guard_sequence_lengths(module: nn.Module, tp_plan: dict[str, Any], tp: int) -> None:
    """Check every call of the model ``tp_plan`` splits with :func:`check_sequence_length`, before its forward:
    a pre-hook on the plan's root (the innermost module holding all it names that is not a ModuleList or
    ModuleDict), or, when that is ``module`` itself (which Lightning does not call), on each child of
    ``module`` the plan names."""
    root = _common_root(tp_plan)
    while root and isinstance(module.get_submodule(root), (nn.ModuleList, nn.ModuleDict)):  # never called
        root = parent_fqn(root)
    for fqn in [root] if root else sorted({key.split(".")[0] for key in tp_plan}):
        model = module.get_submodule(fqn)
        model.register_forward_pre_hook(partial(_check_call, tp=tp, name=f"{fqn} ({type(model).__name__})"),
                                        with_kwargs=True, prepend=True)


def _check_call(_: nn.Module, args: tuple, kwargs: dict[str, Any], *, tp: int, name: str) -> None:
    check_sequence_length(args, kwargs, tp, model=name)


def _common_root(tp_plan: dict[str, Any]) -> str:
    """The longest FQN prefix the plan's keys share, before any ``*``, that is no key's last name."""
    keys = [key.split(".") for key in tp_plan]
    common: list[str] = []
    for atoms in zip(*keys):
        if len(set(atoms)) > 1 or "*" in atoms[0]:
            break
        common.append(atoms[0])
    if keys and len(common) == min(len(k) for k in keys):  # one key only, or one is the others' parent
        common = common[:-1]
    return ".".join(common)
