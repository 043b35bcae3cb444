"""The inputs a model gives one of its blocks, captured on the meta device: what the block trace
(:mod:`~lightning_3d.policies.block_trace`) runs the block on, so that rotary tables, masks and positions are
the model's own."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from lightning_3d.policies.experts import experts_stood_in
from lightning_3d.policies.meta_values import MetaValues


SKIPPED = "the forward ran to its end without calling the block"


class _Stop(Exception):
    pass


def block_inputs(model: nn.Module, block: nn.Module, width: int, tokens: int = 4) -> tuple[tuple, dict] | str:
    """The positional and keyword arguments ``model`` (on the meta device) passes ``block`` when called on
    one sequence of ``tokens`` token ids, or of hidden states ``width`` wide (for a forward that requires
    more: masks of ones); when no such call reaches the block, why the first call failed."""
    seen: dict[str, Any] = {}
    failures: list[str] = []

    def stop(_module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Stop

    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    extra = required_positionals(model) - 1

    def ids():
        return torch.zeros(1, tokens, dtype=torch.long)

    def hidden():
        return torch.zeros(1, tokens, width)

    def masks():
        return [torch.ones(1, tokens, dtype=torch.long)] * extra

    calls = [lambda: model(ids(), use_cache=False), lambda: model(ids()), lambda: model(ids(), *masks()),
             lambda: model(hidden()), lambda: model(hidden(), *masks())]
    try:
        for call in calls:
            try:
                # On meta, the inputs made here and what the forward derives from them carry host values
                # (MetaValues): mask code that reads them (packed sequences, an all-ones padding mask) runs.
                # The experts of the blocks before it stand in for themselves (routing reads values).
                with torch.no_grad(), torch.device("meta"), MetaValues(), experts_stood_in(model):
                    call()
                # A forward that skips the block on token ids (a layer for inputs of another kind: images): what
                # the other calls failed on is beside the point.
                failures.insert(0, SKIPPED)
            except _Stop:
                first = next((a for a in [*seen["args"], *seen["kwargs"].values()] if isinstance(a, Tensor)), None)
                if first is None or not first.is_floating_point() or first.shape[-1] != width:
                    continue  # not hidden states: this call is not how the model is meant to be called
                # A key/value cache would grow with every trace of the block: each trace starts without one.
                args = tuple(_no_cache(a) for a in seen["args"])
                return args, {k: _no_cache(v) for k, v in seen["kwargs"].items()}
            except Exception as err:  # noqa: BLE001 -- a forward meta cannot run, or one that takes other inputs
                failures.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                continue
    finally:
        handle.remove()
    return failures[0] if failures else "no call of the model with token ids or hidden states reached the block"


def required_positionals(module: nn.Module) -> int:
    """How many positional arguments ``module``'s forward requires."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


def _no_cache(value: Any) -> Any:
    return None if type(value).__name__.endswith("Cache") else value
