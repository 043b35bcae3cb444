"""The stand-ins that take the pipeline root's place (``self.model``) while the user's step runs under the engine.

:class:`CaptureInputs` stops the step at the model call and hands its inputs to the engine (every rank, per
micro-batch); :class:`ReturnOutput` returns the last stage's output instead of computing it, so the user's
own code computes the loss from it. Both forward attribute access to the real root (``self.model.config``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

from lightning_3d.pipeline.step_checks import ModelCalls


class ModelInputs(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured the pipeline root's inputs")
        self.args, self.kwargs = args, kwargs


class StandIn(nn.Module):
    """Takes the pipeline root's place while the user's step runs; attribute access (``self.model.config``)
    reaches the real root, kept outside the module tree so its parameters are not counted twice."""

    def __init__(self, real: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


class CaptureInputs(StandIn):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelInputs(args, kwargs)


class ReturnOutput(StandIn):
    def __init__(self, real: nn.Module, output: Any, calls: ModelCalls) -> None:
        super().__init__(real)
        object.__setattr__(self, "_output", output)
        object.__setattr__(self, "_calls", calls)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._calls.called()
        return self._output


@contextmanager
def swapped(module: nn.Module, fqn: str, stand_in: nn.Module) -> Iterator[None]:
    parent_name, _, name = fqn.rpartition(".")
    parent = module.get_submodule(parent_name)
    real = getattr(parent, name)
    setattr(parent, name, stand_in)
    try:
        yield
    finally:
        setattr(parent, name, real)
