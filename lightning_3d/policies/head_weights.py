"""A module's own weights with one value per attention head, split with the heads.

Some attention modules hold, beside their projections, a weight of one value per query head that they apply
to the scores or the output: gpt-oss's and Granite's attention sinks (a learned extra logit per head), a
per-head gate bias. At tp, rank r computes heads ``[r H/tp, (r+1) H/tp)``, so it keeps those heads' values
(``Shard(0)``), and the module's forward, written for one device, sees them as a plain local tensor of H/tp
values (:func:`shadowed`). Each rank's gradient of them is its own heads' only: nothing to sum.

Found by :mod:`~lightning_3d.policies.tp_structure` (the one-dimensional weights of the modules holding an
attention region, of the region's head count) and checked there by tracing each rank's block with them cut.
"""

from __future__ import annotations

import contextlib

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class HeadWeights(ParallelStyle):
    """Splits ``names`` (weights of the module, one value per head) over tp; ``inner``: the module's other
    style (the region's hidden states, when they enter here), applied first.

    Example (gpt-oss)::

        {"model.layers.*.self_attn": HeadWeights(["sinks"])}
    """

    def __init__(self, names: list[str], inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.names, self.inner = list(names), inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        for name in self.names:
            param = getattr(module, name)
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        forward = module.forward

        def local_forward(*args, **kwargs):
            with shadowed(module, {name: getattr(module, name).to_local() for name in self.names}):
                return forward(*args, **kwargs)

        module.forward = local_forward
        return module

    def __repr__(self) -> str:
        return f"HeadWeights({self.names}" + (f", inner={self.inner!r})" if self.inner is not None else ")")


@contextlib.contextmanager
def shadowed(module: nn.Module, tensors: dict[str, Tensor]):
    """While the block runs (inside the context), ``module.<name>`` reads ``tensors[name]`` (an instance attribute shadows the
    registered parameter of that name; ``state_dict`` and the optimizer still see the parameter)."""
    vars(module).update(tensors)
    try:
        yield
    finally:
        for name in tensors:
            del vars(module)[name]
