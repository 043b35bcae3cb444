"""A parallel style for the hidden states alone: the first input of a module, or the first tensor it returns.

PyTorch's ``PrepareModuleInput`` / ``PrepareModuleOutput`` want a layout for every positional input or output.
A plan found by structure (policy "auto") knows that a block, an attention or an MLP takes the hidden states
first, but not what else the model passes it (a mask, a rotary table, positions) nor whether a block returns
a tuple; this style converts the hidden states and leaves everything else as it is.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement
from torch.distributed.tensor.parallel import ParallelStyle


class HiddenStates(ParallelStyle):
    """Gives a module's hidden states the layout ``input`` = (as they come, as the module wants them) on the
    way in, and ``output`` = (as the module returns them, as the caller wants them) on the way out; either
    may be None. The converted hidden states are local tensors with ``use_local_output`` (default), else
    DTensors. ``partial_gradient``: local tensors, whose gradient each rank returns is its share, summed (or
    reduce-scattered) here on the way back.

    Example (the residual stream split along the sequence entering the first block, gathered after the last)::

        {"model.layers.0": HiddenStates(input=(Replicate(), Shard(1))),
         "model.layers.7": HiddenStates(output=(Shard(1), Replicate()))}
    """

    def __init__(self, *, input: tuple[Placement, Placement] | None = None,
                 output: tuple[Placement, Placement] | None = None, use_local_output: bool = True,
                 partial_gradient: bool = False) -> None:
        super().__init__()
        self.input, self.output, self.use_local_output = input, output, use_local_output
        self.partial_gradient = partial_gradient

    def _convert(self, x: Any, mesh: DeviceMesh, layouts: tuple[Placement, Placement]) -> Any:
        if not isinstance(x, Tensor):
            return x
        current, desired = layouts
        dt = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (current,), run_check=False)
        if dt.placements != (desired,):
            dt = dt.redistribute(placements=(desired,))
        if self.partial_gradient:  # the module computes on local tensors; each rank's gradient is its share
            return dt.to_local(grad_placements=[Partial()])
        return dt.to_local() if self.use_local_output else dt

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.input is not None:
            module.register_forward_pre_hook(
                lambda _, args, kwargs: self._prepare_input(args, kwargs, device_mesh), with_kwargs=True)
        if self.output is not None:
            module.register_forward_hook(lambda _, args, output: self._prepare_output(output, device_mesh))
        return module

    def _prepare_input(self, args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
        if args:
            return (self._convert(args[0], mesh, self.input), *args[1:]), kwargs
        # Passed by keyword only (hidden_states=...): the first tensor argument.
        name = next((k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
        return args, kwargs if name is None else {**kwargs, name: self._convert(kwargs[name], mesh, self.input)}

    def _prepare_output(self, output: Any, mesh: DeviceMesh) -> Any:
        if isinstance(output, (tuple, list)) and output:
            items = [self._convert(output[0], mesh, self.output), *output[1:]]
            return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)  # namedtuple
        return self._convert(output, mesh, self.output)

    def __repr__(self) -> str:
        partial = ", partial_gradient=True" if self.partial_gradient else ""
        return f"HiddenStates(input={self.input}, output={self.output}, use_local_output={self.use_local_output}{partial})"
