"""Column- and row-wise tensor parallelism for any projection: ``nn.Linear``, transformers' ``Conv1D``, fused.

PyTorch's ``ColwiseParallel`` / ``RowwiseParallel`` take ``nn.Linear`` (weight ``(out, in)``) with one slice of
the outputs per rank. Two things real models add, each only a placement:

* **Conv1D** (GPT-2 and its kin): ``x @ weight + bias`` with ``weight`` stored ``(in, out)``, so the output
  features are weight dim 1, the input features dim 0.
* **Fused outputs**: ``[q | k | v]`` (nanoGPT's ``c_attn``, Phi-3's ``qkv_proj``) or ``[gate | up]``
  (Phi-3's ``gate_up_proj``) are k side-by-side projections in one weight. Each rank needs its own slice of
  every part (its heads' q, k and v; its gates and their ups): ``_StridedShard(dim, split_factor=k)`` is
  exactly that. DTensor computes with it (the output is ``_StridedShard(-1, k)``; gradients keep the
  weight's placement), and the local output is ``[q_r | k_r | v_r]``, which the model's own ``split`` then
  cuts once its sizes are per rank. The parameter keeps its single-device name, shape and order, so
  checkpoints keep the single-device layout (``lightning_3d.checkpoint.boxes`` writes a rank's k boxes).
  Parts of unequal sizes (``[q | k | v]`` with fewer kv heads than query heads) have no such placement: the
  weight is stored with its features in rank order and split with ``Shard`` (``lightning_3d.fused_parts``).
  So are parts every rank keeps whole (``whole``: k and v of Falcon's one kv head): each rank's gradient of
  them covers its own query heads only, and the projection sums it over tp.

The column output is always returned as this rank's local columns, as they come: a fused output must not be
redistributed (that would reorder it into a plain ``Shard``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_map

from lightning_3d.common import local
from lightning_3d.fused_parts import ATTRIBUTE, FusedParts, distribute_parameter, record
from lightning_3d.policies.local_tensors import gradient_summed, local_parts, shadowed


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


class ColumnSplit(ColwiseParallel):
    """Column-wise for an ``nn.Linear`` or ``Conv1D``; ``parts=k``: its outputs are k equal fused parts and
    each rank keeps its slice of every one; ``parts=(n_1, ..., n_k)``: the fused parts' sizes, equal or not.
    ``copy_output``: for a model that changes the output in place. ``output_layouts=Replicate()``: the output
    gathered whole on every rank, for a projection whose output the block uses whole (its weight and work
    still split; the gradient of the gathered output is whole on every rank, each keeps its slice).

    Example (nanoGPT's fused attention input; Phi-3's with 4 query heads and 2 kv heads of 8 features; RWKV's
    gate on its MLP's output)::

        {"model.transformer.h.*.attn.c_attn": ColumnSplit(parts=3)}
        {"model.model.layers.*.self_attn.qkv_proj": ColumnSplit(parts=(32, 16, 16))}
        {"model.rwkv.blocks.*.feed_forward.receptance": ColumnSplit(output_layouts=Replicate())}
    """

    def __init__(self, *, parts: int | tuple[int, ...] = 1, whole: tuple[bool, ...] = (), copy_output: bool = False,
                 local_input: bool = False, gather_output: bool = False,
                 picked: tuple[tuple[int, ...], ...] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.parts, self.whole, self.copy_output = parts, tuple(whole), copy_output
        self.local_input, self.gather_output, self.picked = local_input, gather_output, picked

    def _placement(self, dim: int) -> Placement:
        k = len(self.parts) if isinstance(self.parts, tuple) else self.parts
        return Shard(dim) if k == 1 or self._in_rank_order() else _StridedShard(dim, split_factor=k)

    def _in_rank_order(self) -> bool:
        return isinstance(self.parts, tuple) and (len(set(self.parts)) > 1 or any(self.whole))

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        weight_dim = 0 if is_linear(module) else 1  # the output features
        for param, dim in (("weight", weight_dim), ("bias", 0)):
            order = FusedParts(dim, self.parts, mesh.size(), self.whole) if self._in_rank_order() else None
            if distribute_parameter(module, param, mesh, self._placement(dim), self.src_data_rank, order) and order:
                record(module, param, order)

    def _local_columns(self, mod, outputs, device_mesh):
        if self.output_layouts != (Shard(-1),):  # used whole (or per position under sequence parallelism)
            outputs = outputs.redistribute(placements=self.output_layouts)
        return _local(outputs, self.copy_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        prepare = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        if not any(self.whole) and not self.local_input:
            return distribute_module(module, device_mesh, self._partition, prepare, self._local_columns)
        distribute_module(module, device_mesh, self._partition, None if self.local_input else prepare)
        picked = None if self.picked is None else torch.tensor(self.picked[device_mesh.get_local_rank()], dtype=torch.long)
        module.forward = _LocalForward(module, device_mesh, self.copy_output, self.local_input, self.gather_output, picked)
        return module

    def __repr__(self) -> str:
        whole = f", whole={self.whole}" if any(self.whole) else ""
        local = ", local_input=True" if self.local_input else ""
        gather = ", gather_output=True" if self.gather_output else ""
        gather += f", picked={self.picked}" if self.picked is not None else ""
        output = f", output_layouts={self.output_layouts}" if self.output_layouts != (Shard(-1),) else ""
        return f"ColumnSplit(parts={self.parts}{whole}{local}{gather}, input_layouts={self.input_layouts}{output})"


class _LocalForward:
    """The forward of a column projection on this rank's local tensors, for parts every rank keeps whole and
    for regions computed on local tensors. The input's gradient is this rank's share: summed over tp here (as
    any column's), or, with ``local_input``, where the region's hidden states entered. The gradient of the
    whole parts' weights is a share too, summed here (the rest of the weight is this rank's own).
    ``gather``: the output is gathered whole on every rank (MLA's low-rank ``q_a_proj``, normed whole next).
    ``picked``: of a weight every rank keeps whole, the output features this rank computes (its slice of a
    projection the heads cut unevenly; the others' rows get no gradient here)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, copy_output: bool, local_input: bool = False,
                 gather: bool = False, picked: torch.Tensor | None = None) -> None:
        self.module, self.mesh, self.copy_output = module, mesh, copy_output
        self.local_input, self.gather, self.picked = local_input, gather, picked

    def __call__(self, x) -> torch.Tensor:
        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()])
        elif not self.local_input:
            x = gradient_summed(x, self.mesh)
        layouts = vars(self.module).get(ATTRIBUTE, {})
        weight, bias = (self._local(name, layouts) for name in ("weight", "bias"))
        if self.picked is not None:
            rows = self.picked.to(weight.device)
            weight = weight.index_select(0 if is_linear(self.module) else 1, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        if is_linear(self.module):
            out = F.linear(x, weight, bias)
        else:  # Conv1D, as it computes: weight (in, out), bias added by the same kernel
            out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[-1])
        if self.gather:  # each rank's gradient of the whole output is a share: reduce-scattered on the way back
            out = (DTensor.from_local(out, self.mesh, [Shard(out.dim() - 1)], run_check=False)
                   .redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()]))
        return out.clone() if self.copy_output else out

    def _local(self, name: str, layouts: dict) -> torch.Tensor | None:
        param = getattr(self.module, name, None)
        if param is None:
            return None
        return local_parts(param, layouts.get(name), self.mesh)


class SummedGradients(ParallelStyle):
    """A module left whole on every tp rank, in a region computed on local tensors, where each rank's gradient
    is a share (MLA's ``q_a_layernorm``, on the gathered low-rank query): its weights' gradients are summed over
    tp in the backward pass.

    ``shared_by_heads``: its weights are ones every head applies alike (a relative position bias's bank of
    profiles), which a split by heads keeps whole on every rank by design.

    Example (DeepSeek-V3)::

        {"model.layers.*.self_attn.q_a_layernorm": SummedGradients()}
    """

    def __init__(self, *, shared_by_heads: bool = False) -> None:
        super().__init__()
        self.shared_by_heads = shared_by_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        forward, names = module.forward, [name for name, _ in module.named_parameters(recurse=False)]

        def summed(*args, **kwargs):
            tensors = {name: gradient_summed(getattr(module, name), device_mesh) for name in names}
            with shadowed(module, tensors):
                return forward(*args, **kwargs)

        module.forward = summed
        return module

    def __repr__(self) -> str:
        return f"SummedGradients({'shared_by_heads=True' if self.shared_by_heads else ''})"


class RowSplit(RowwiseParallel):
    """Row-wise for an ``nn.Linear`` or ``Conv1D``: the input features split, the bias whole (added once, to
    the reduced output). ``copy_output``: for a model that changes the output in place. ``summed_gradient``:
    a row inside a region (Mamba's ``x_proj``), whose whole output every rank's heads read, so that each
    rank's gradient of it is a share, summed over tp on the way back as the output is on the way out.

    Example (Mamba: each rank's channels give their share of every step size, B and C)::

        {"backbone.layers.*.mixer.x_proj": RowSplit(output_layouts=Replicate(), summed_gradient=True)}
    """

    def __init__(self, *, copy_output: bool = False, summed_gradient: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.copy_output, self.summed_gradient = copy_output, summed_gradient

    def _reduced(self, mod, outputs, device_mesh):
        if outputs.placements != self.output_layouts:
            outputs = outputs.redistribute(placements=self.output_layouts, async_op=True)
        if not self.use_local_output:
            return outputs
        local = _local(outputs, self.copy_output)
        return gradient_summed(local, device_mesh) if self.summed_gradient else local

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        distribute_parameter(module, "weight", mesh, Shard(1 if is_linear(module) else 0), self.src_data_rank)
        distribute_parameter(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts), self._reduced,
        )

    def __repr__(self) -> str:
        summed = ", summed_gradient=True" if self.summed_gradient else ""
        return f"RowSplit(output_layouts={self.output_layouts}{summed})"


def _local(output, copy: bool):
    """The local tensor of a DTensor output; a copy where the model changes it in place (autograd forbids
    changing a custom function's view in place)."""
    local = output.to_local()
    return local.clone() if copy else local


class OnSplitFeatures(SequenceParallel):
    """A module with weights of its own that runs inside a split region, on this rank's share of the columns'
    outputs (Qwen3's per-head ``q_norm``): its weights stay whole on every rank, its input is taken as cut
    along ``dim`` over tp. Each rank's gradient of the weights covers only its own share, so it is a pending
    sum (``Partial``) that the step completes over tp, as for the norms under sequence parallelism.

    Example (Qwen3's query and key norms, input ``(batch, tokens, heads, head_dim)``)::

        {"model.layers.*.self_attn.q_norm": OnSplitFeatures(dim=2)}
    """

    def __init__(self, *, dim: int) -> None:
        super().__init__(sequence_dim=dim, use_local_output=False)  # each output made local after: tuples too
        self.dim = dim

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        """Every tensor input of the first one's dimensions is cut alike (a gated norm's ``gate``, beside its input;
        the keys beside the queries, of fewer heads)."""
        first = inputs[0]
        return tuple(SequenceParallel._prepare_input_fn(sequence_sharding, mod, (x,), device_mesh)
                     if isinstance(x, torch.Tensor) and x.dim() == first.dim() else x for x in inputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(_local_outputs)
        return module

    def __repr__(self) -> str:
        return f"OnSplitFeatures(dim={self.dim})"


def _local_outputs(module: nn.Module, inputs, outputs):
    """A forward hook: each DTensor output as this rank's local share (a norm of q and k returns both)."""
    return tree_map(local, outputs)
