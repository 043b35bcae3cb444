"""policy="auto" at tp on a projection outside every region whose output the block uses whole (RWKV's
receptance gate on its MLP's output): split by output features, its output gathered; a router is not."""

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.projections import ColumnSplit


class _GatedBlock(nn.Module):
    """An MLP whose output a gate of the hidden states scales after its down projection; ``routed``: the gate's
    output also picks the top feature, as a router picks experts."""

    def __init__(self, routed: bool = False):
        super().__init__()
        self.routed = routed
        self.norm = nn.LayerNorm(16)
        self.up, self.down, self.gate = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        gate = torch.sigmoid(self.gate(h))
        if self.routed:
            gate = gate * 0 + gate.topk(1, dim=-1).values
        return x + gate * self.down(torch.relu(self.up(h)))


def _plan(**kwargs):
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_GatedBlock(**kwargs) for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=2, allow_replicated=True))


def test_a_gate_after_the_row_projection_is_split_and_its_output_gathered():
    root, found = _plan()
    gate = found.tp_plan["model.layers.0.gate"]
    assert isinstance(gate, ColumnSplit) and gate.output_layouts == (Replicate(),)
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded == total - 16 * 2 * 2 - 16 * 2  # all but each block's norm and down bias


def test_a_projection_whose_output_picks_among_its_features_is_not_gathered():
    _, found = _plan(routed=True)
    assert "model.layers.0.gate" not in found.tp_plan


class _ModulatedNormBlock(nn.Module):
    """An MLP on the hidden states normed and scaled by a small MLP of them (AXK2's norm): the scale's
    projections stay whole, the MLP reads them mixed with the stream, and splits as usual."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 4), nn.Linear(4, 16)
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.norm(x) * (1 + self.fc2(torch.relu(self.fc1(x))))
        return x + self.down(torch.relu(self.up(h)))


def test_an_mlp_reading_the_stream_scaled_by_whole_projections_of_it_is_split():
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_ModulatedNormBlock() for _ in range(2))})})
    found = AutoPolicy().plan(root, PlanOptions(tp=2, allow_replicated=True))
    assert isinstance(found.tp_plan["model.layers.0.up"], ColumnSplit)
    assert "model.layers.0.fc2" not in found.tp_plan  # whole: it computes what every rank computes
