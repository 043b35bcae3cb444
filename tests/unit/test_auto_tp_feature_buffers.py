"""policy="auto" at tp on a non-persistent buffer of one value per output feature of a fused column (Falcon-H1's
``mup_vector`` on its ``[z | x | B | C | dt]``): the buffer stays whole, and each rank reads the values of its own
features, in the order its share of the fused column lays them out."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.fused_parts import FusedParts
from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.head_weights import HeadWeights

HIDDEN, INTERMEDIATE, TP = 16, 32, 2


class _FusedScaledBlock(nn.Module):
    """A fused ``[gate | up]`` column whose outputs the block scales by a buffer, one value per feature (all
    different, so a rank reading another's would show), then the row."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.gate_up, self.down = nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False), nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 2 * INTERMEDIATE).view(1, 1, -1), persistent=False)

    def forward(self, x):
        gate, up = (self.gate_up(self.norm(x)) * self.scale).chunk(2, dim=-1)  # (B, T, I) each
        return x + self.down(F.silu(gate) * up)


class _Mesh:
    """What the buffer's style asks of a tp mesh, for one rank, in one process."""

    def __init__(self, rank: int):
        self.rank = rank

    def size(self) -> int:
        return TP

    def get_local_rank(self) -> int:
        return self.rank


def _plan():
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_FusedScaledBlock() for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=TP))


def test_a_buffer_per_feature_of_a_fused_column_splits_with_its_parts():
    _, found = _plan()
    style = found.tp_plan["model.layers.0"]
    assert isinstance(style, HeadWeights) and style.names == ["scale"]
    assert style.parts == {"scale": (INTERMEDIATE, INTERMEDIATE)}
    assert found.tp_plan["model.layers.0.gate_up"].parts == (INTERMEDIATE, INTERMEDIATE)


def test_each_rank_reads_its_features_values_of_the_buffer_and_the_ranks_sum_to_one_process():
    root, found = _plan()
    block = root["model"]["layers"][0]
    x = torch.randn(2, 3, HIDDEN)
    summed = x.clone()
    for rank in range(TP):
        local = copy.deepcopy(block)
        rows = FusedParts(0, (INTERMEDIATE, INTERMEDIATE), TP).held_by(rank)  # this rank's gates, then its ups
        local.gate_up.weight = nn.Parameter(block.gate_up.weight[rows])
        local.down.weight = nn.Parameter(block.down.weight[:, rank * INTERMEDIATE // TP:(rank + 1) * INTERMEDIATE // TP])
        found.tp_plan["model.layers.0"]._apply(local, _Mesh(rank))
        assert torch.equal(local.scale, block.scale)  # stored whole, as any initialization writes it
        summed += local(x) - x
    torch.testing.assert_close(summed, block(x))
