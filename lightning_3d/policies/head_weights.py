"""A module's weights with one value per attention head, or one filter per channel, split with them.

Some attention modules hold, beside their projections, a weight of one value per query head that they apply
to the scores or the output: gpt-oss's and Granite's attention sinks (a learned extra logit per head), a
per-head gate bias. At tp, rank r computes heads ``[r H/tp, (r+1) H/tp)``, so it keeps those heads' values
(``Shard(0)``), and the module's forward, written for one device, sees them as a plain local tensor of H/tp
values (:func:`shadowed`). Each rank's gradient of them is its own heads' only: nothing to sum.

A non-persistent buffer of one value per feature (Falcon-H1's ``mup_vector``) is named here too: it stays
whole, and the module reads this rank's features' values of it (:func:`_buffer_reader`).

The same holds for a depthwise convolution on a region's split features (LFM2's short convolution, Mamba's
``conv1d``): one filter per channel, rank r keeps the filters of its channels. Its weights are named from the
module holding the region (``conv.weight``): the model may read them there without calling the convolution.

Found by :mod:`~lightning_3d.policies.tp_structure` (the one-dimensional weights of the modules holding an
attention region, of the region's head count; the convolutions the trace saw run on one channel each) and
checked there by tracing each rank's block with them cut.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_3d.fused_parts import FusedParts, distribute_parameter, record
from lightning_3d.policies.feature_weights import split_dim
from lightning_3d.policies.local_tensors import local_parts, shadowed


class HeadWeights(ParallelStyle):
    """Splits ``names`` (weights of the module or of its submodules, one value per head or channel first) over
    tp along dim 0; ``inner``: the module's other style (the region's hidden states, when they enter here),
    applied first; ``parts``: name -> the sizes of the parts its channels are made of, of which each rank keeps
    one chunk each (a convolution over ``[q | k | v]``), as ``ColumnSplit(parts=...)`` keeps a fused output's;
    ``whole``: name -> per part, whether every rank keeps it whole (its gradient then summed over tp).
    While the module runs, each name reads this rank's part as a plain tensor.

    Example (gpt-oss; LFM2's short convolution)::

        {"model.layers.*.self_attn": HeadWeights(["sinks"])}
        {"model.layers.*.conv": HeadWeights(["conv.weight", "conv.bias"])}
    """

    def __init__(self, names: list[str], inner: ParallelStyle | None = None,
                 parts: dict[str, tuple[int, ...]] | None = None, whole: dict[str, tuple[bool, ...]] | None = None) -> None:
        super().__init__()
        self.names, self.inner, self.parts, self.whole = list(names), inner, dict(parts or {}), dict(whole or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        owners = {}
        for name in self.names:
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            parts, whole = self.parts.get(name, ()), self.whole.get(name, ())
            if leaf in dict(owner.named_buffers(recurse=False)):
                owners.setdefault(path, (owner, []))[1].append((leaf, _buffer_reader(owner, leaf, parts, whole, device_mesh)))
                continue
            if len(parts) > 1 and len(set(parts)) == 1 and not any(whole):  # [q | k | v]: this rank's chunk of each
                placement, order = _StridedShard(0, split_factor=len(parts)), None
            else:  # unequal parts, or parts every rank keeps whole (Mamba-2's B and C of one group): in rank order
                placement = Shard(split_dim(getattr(owner, leaf)) if len(parts) <= 1 else 0)
                order = FusedParts(0, parts, device_mesh.size(), whole) if len(parts) > 1 else None
            if distribute_parameter(owner, leaf, device_mesh, placement, self.src_data_rank, order) and order:
                record(owner, leaf, order)
            owners.setdefault(path, (owner, []))[1].append(
                (leaf, lambda owner=owner, leaf=leaf, order=order: local_parts(getattr(owner, leaf), order, device_mesh)))
        forward = module.forward

        def local_forward(*args, **kwargs):
            with contextlib.ExitStack() as stack:
                for owner, leaves in owners.values():
                    local = {leaf: read() for leaf, read in leaves}
                    stack.enter_context(shadowed(owner, local))
                return forward(*args, **kwargs)

        module.forward = local_forward
        return module

    def __repr__(self) -> str:
        parts = f", parts={self.parts}" if self.parts else ""
        return f"HeadWeights({self.names}{parts}" + (f", inner={self.inner!r})" if self.inner is not None else ")")


def _buffer_reader(owner: nn.Module, leaf: str, parts: tuple[int, ...], whole: tuple[bool, ...], mesh: DeviceMesh):
    """What reads this rank's values of the buffer ``owner.leaf``, kept whole (single-device values, however it
    is initialized later): those at the positions of this rank's features along :func:`split_dim`, in the order
    its features are laid out (its chunk of each of ``parts``, a ``whole`` part entire)."""
    buffer = getattr(owner, leaf)
    dim = split_dim(buffer)
    held = FusedParts(dim, parts or (buffer.shape[dim],), mesh.size(), whole).held_by(mesh.get_local_rank())
    positions = torch.tensor(held, dtype=torch.long)

    def read() -> Tensor:
        buffer = getattr(owner, leaf)
        return buffer.index_select(dim, positions.to(buffer.device))
    return read
