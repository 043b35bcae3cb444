"""Mixture-of-experts weights split over tp like any MLP, each expert by its intermediate features.

transformers stores a block's experts as stacked matrices in one module (``MixtralExperts``, ``Qwen3MoeExperts``,
``GptOssExperts``...), called as ``experts(hidden_states, top_k_index, top_k_weights)`` and described by the
flags its ``use_experts_implementation`` decorator sets: ``has_gate`` (``gate_up_proj`` (E, 2I, H), else
``up_proj`` (E, I, H)), ``is_transposed`` (stored (E, H, 2I) and (E, I, H)), ``is_concatenated`` (``[gate | up]``
as two halves, else interleaved pairs) and ``has_bias``. :func:`experts_layout` reads those flags.

At tp, every rank keeps, of every expert, the intermediate features ``[r I/tp, (r+1) I/tp)``: its slice of the
up projection (its gates and their ups: ``_StridedShard`` over the two halves, a plain ``Shard`` of interleaved
pairs) and the same inputs of the down projection. The router stays whole and routes the same tokens on every
rank. Each rank then runs the module's own forward, whatever implementation the config picked, on its local
weights (:class:`ExpertsSplit`), and the ranks' outputs are summed:

* the output is this rank's share of every token's expert sum: summed over tp (forward), its gradient as is;
* the hidden states and the routing weights are read by every rank's share: their gradients are summed over tp
  (the router so gets one process's gradient);
* the down projection's bias is added once, by tp rank 0, and its gradient summed over tp.

Each expert stays whole on the expert dimension, so expert parallelism can later split that dimension instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_3d.policies.local_tensors import gradient_summed, shadowed

FLAGS = ("has_gate", "is_transposed", "is_concatenated", "has_bias")
"""The attributes transformers' ``use_experts_implementation`` sets on an experts module."""


@dataclass(frozen=True)
class ExpertsLayout:
    """Where an experts module keeps its intermediate features."""

    up: str
    """``gate_up_proj`` or ``up_proj``."""
    up_dim: int
    """The dimension of ``up`` that holds the intermediate features (1, or 2 when transposed)."""
    halves: bool
    """``[gate | up]`` as two halves of ``up_dim`` (each rank keeps its slice of both)."""
    down_dim: int
    """The dimension of ``down_proj`` that holds the intermediate features (2, or 1 when transposed)."""
    bias: bool

    @property
    def intermediate(self) -> str:
        return f"{self.up}.shape[{self.up_dim}]"


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module (see the module docstring)."""
    return all(hasattr(module, flag) for flag in FLAGS) and isinstance(getattr(module, "down_proj", None), Tensor)


def experts_layout(module: nn.Module, tp: int) -> tuple[ExpertsLayout | None, str]:
    """How ``module`` (:func:`is_experts`) splits over ``tp`` ranks, or None and why it does not."""
    if getattr(module, "has_post_expert_norm", False) or any(
            any(True for _ in child.parameters()) for child in module.children()):
        return None, "a module with weights (a norm) runs on each expert's output, which tp would see in pieces"
    if not hasattr(type(module).forward, "__wrapped__"):  # the decorator's dispatch wraps the class's forward
        return None, (f"{type(module).__name__}.forward does more than the experts implementation it calls, on"
                      " outputs that tp would see in pieces")
    transposed = bool(module.is_transposed)
    layout = ExpertsLayout(up="gate_up_proj" if module.has_gate else "up_proj", up_dim=2 if transposed else 1,
                           halves=bool(module.has_gate and module.is_concatenated),
                           down_dim=1 if transposed else 2, bias=bool(module.has_bias))
    up, down = getattr(module, layout.up, None), module.down_proj
    if not isinstance(up, Tensor) or up.dim() != 3 or down.dim() != 3:
        return None, f"it holds no 3-D {layout.up} and down_proj (experts, features, features)"
    intermediate = down.shape[layout.down_dim]
    if up.shape[layout.up_dim] != intermediate * (2 if module.has_gate else 1):
        return None, f"{layout.up} {tuple(up.shape)} and down_proj {tuple(down.shape)} disagree on the intermediate size"
    if intermediate % tp:
        return None, f"each expert's {intermediate} intermediate features do not divide by tensor_parallel_size={tp}"
    return layout, ""


class ExpertsSplit(ParallelStyle):
    """Splits an experts module's intermediate features over tp (see the module docstring).

    Example (Mixtral)::

        {"model.layers.*.mlp.experts": ExpertsSplit(layout)}  # layout = experts_layout(module, tp)[0]
    """

    def __init__(self, layout: ExpertsLayout) -> None:
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition)
        module.forward = _SplitForward(module, module.forward, device_mesh)
        return module

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # the module's own weights only
            return
        up_split = _StridedShard(self.layout.up_dim, split_factor=2) if self.layout.halves else Shard(self.layout.up_dim)
        bias_split = _StridedShard(1, split_factor=2) if self.layout.halves else Shard(1)
        for param, placement in ((self.layout.up, up_split), ("down_proj", Shard(self.layout.down_dim)),
                                 (f"{self.layout.up}_bias", bias_split), ("down_proj_bias", Replicate())):
            tensor = getattr(module, param, None)
            if isinstance(tensor, nn.Parameter) and not isinstance(tensor, DTensor):
                sharded = distribute_tensor(tensor, mesh, [placement], src_data_rank=self.src_data_rank)
                module.register_parameter(param, nn.Parameter(sharded, requires_grad=tensor.requires_grad))

    def __repr__(self) -> str:
        return f"ExpertsSplit({self.layout.intermediate})"


class _SplitForward:
    """The experts module's own forward, run on this rank's weights; its output summed over tp."""

    def __init__(self, module: nn.Module, forward, mesh: DeviceMesh) -> None:
        self.module, self.forward, self.mesh = module, forward, mesh

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args, **kwargs) -> Tensor:
        hidden_states, top_k_weights = gradient_summed(hidden_states, self.mesh), gradient_summed(top_k_weights, self.mesh)
        with _local_weights(self.module, self.mesh):
            share = self.forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return DTensor.from_local(share, self.mesh, [Partial()], run_check=False).redistribute(
            placements=[Replicate()]).to_local()


def _local_weights(module: nn.Module, mesh: DeviceMesh):
    """``module``'s split weights seen as this rank's local tensors while its forward runs; the replicated down
    bias as its once-added share."""
    local = {}
    for name, param in module.named_parameters(recurse=False):
        if not isinstance(param, DTensor):
            continue
        if param.placements[0].is_replicate():  # down_proj_bias: added by rank 0, its gradient summed over tp
            local[name] = gradient_summed(param.to_local(), mesh) * (1.0 if mesh.get_local_rank() == 0 else 0.0)
        else:
            local[name] = param.to_local()
    return shadowed(module, local)


@contextlib.contextmanager
def experts_stood_in(block: nn.Module):
    """While a block runs without data (traced on the meta device, checked on fake tensors), its experts modules
    run :func:`_stand_in`: routing reads values, and grouped matmuls have no fake kernel for every dtype."""
    experts = {m: m.__dict__.get("forward") for m in block.modules() if is_experts(m)}
    for module in experts:
        module.forward = _stand_in
    try:
        yield
    finally:
        for module, own in experts.items():
            del module.forward
            if own is not None:
                module.forward = own


def _stand_in(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args, **kwargs) -> Tensor:
    """Reads the hidden states and the routing weights, as the experts do, and returns their output's shape."""
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)
