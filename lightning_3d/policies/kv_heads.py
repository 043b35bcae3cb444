"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks.

With ``kv_heads`` key/value heads and ``heads`` query heads, query head ``h`` attends to kv head
``h // (heads // kv_heads)``. When ``kv_heads`` is a multiple of tp, the k and v projections are split
column-wise like the queries (each rank keeps its kv heads). When tp is a multiple of ``kv_heads``, a kv
head serves the query heads of ``tp // kv_heads`` ranks; Megatron-LM then replicates each kv head on those
ranks, and so does :class:`ReplicatedKVHeads`: every rank holds the whole (small) k or v projection and keeps,
of its output, the one kv head its own query heads use. In backward the kept pieces are gathered, so the
gradient of the replicated weight is the whole one on every rank.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel


def kv_head_rule(heads: int, kv_heads: int, tp: int) -> str | None:
    """How the kv heads are placed at this tp size: "split", "replicate", or None when neither works."""
    if heads % tp:
        return None
    if kv_heads % tp == 0:
        return "split"
    if tp % kv_heads == 0:
        return "replicate"
    return None


def allowed_tp_sizes(heads: int, kv_heads: int) -> list[int]:
    """The tensor-parallel sizes :func:`kv_head_rule` accepts."""
    return [tp for tp in range(1, heads + 1) if kv_head_rule(heads, kv_heads, tp)]


class ReplicatedKVHeads(ColwiseParallel):
    """For the k or v ``nn.Linear`` when tp is a multiple of the kv heads: weights replicated, output = this
    rank's kv head (``head_dim`` features), taken from the replicated output without communication."""

    def __init__(self, *, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters():
            replicated = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def _own_kv_head(self, module: nn.Module, output: DTensor, device_mesh: DeviceMesh) -> Tensor:
        # (..., kv_heads * head_dim) -> each kv head repeated for the ranks it serves -> (..., tp * head_dim),
        # split over tp: rank r keeps kv head r // (tp // kv_heads). Replicate -> Shard is a local slice;
        # its backward all-gathers, and the repeat's backward sums the copies of each head.
        tp = device_mesh.size()
        *lead, _ = output.shape
        repeated = (output.view(*lead, self.kv_heads, 1, self.head_dim)
                    .expand(*lead, self.kv_heads, tp // self.kv_heads, self.head_dim)
                    .reshape(*lead, tp * self.head_dim))
        return repeated.redistribute(placements=[Shard(-1)]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"ReplicatedKVHeads applies to nn.Linear, not {type(module).__name__}")
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            lambda mod, outputs, mesh: self._own_kv_head(mod, outputs, mesh),
        )
