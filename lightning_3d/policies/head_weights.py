"""A module's weights with one value per attention head, or one filter per channel, split with them.

Some attention modules hold, beside their projections, a weight of one value per query head that they apply
to the scores or the output: gpt-oss's and Granite's attention sinks (a learned extra logit per head), a
per-head gate bias. At tp, rank r computes heads ``[r H/tp, (r+1) H/tp)``, so it keeps those heads' values
(``Shard(0)``), and the module's forward, written for one device, sees them as a plain local tensor of H/tp
values (:func:`shadowed`). Each rank's gradient of them is its own heads' only: nothing to sum.

The same holds for a depthwise convolution on a region's split features (LFM2's short convolution, Mamba's
``conv1d``): one filter per channel, rank r keeps the filters of its channels. Its weights are named from the
module holding the region (``conv.weight``): the model may read them there without calling the convolution.

Found by :mod:`~lightning_3d.policies.tp_structure` (the one-dimensional weights of the modules holding an
attention region, of the region's head count; the convolutions the trace saw run on one channel each) and
checked there by tracing each rank's block with them cut.
"""

from __future__ import annotations

import contextlib

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class HeadWeights(ParallelStyle):
    """Splits ``names`` (weights of the module or of its submodules, one value per head or channel first) over
    tp along dim 0; ``inner``: the module's other style (the region's hidden states, when they enter here),
    applied first. While the module runs, each name reads this rank's part as a plain tensor.

    Example (gpt-oss; LFM2's short convolution)::

        {"model.layers.*.self_attn": HeadWeights(["sinks"])}
        {"model.layers.*.conv": HeadWeights(["conv.weight", "conv.bias"])}
    """

    def __init__(self, names: list[str], inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.names, self.inner = list(names), inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        owners = {}
        for name in self.names:
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            param = getattr(owner, leaf)
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
            owners.setdefault(path, (owner, []))[1].append(leaf)
        forward = module.forward

        def local_forward(*args, **kwargs):
            with contextlib.ExitStack() as stack:
                for owner, leaves in owners.values():
                    stack.enter_context(shadowed(owner, {leaf: getattr(owner, leaf).to_local() for leaf in leaves}))
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
