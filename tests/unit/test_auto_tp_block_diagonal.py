"""policy="auto" at tp on a block-diagonal per-head projection (RecurrentGemma's RG-LRU gates: a stack of
one matrix per head, applied by ``baddbmm``): the trace follows each output feature to its head's inputs and
its head's weights, which then split with the heads, and the head count the module reshapes by is divided."""

import copy

import torch
from torch import nn

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import expert_banks, sharded_share
from lightning_3d.policies.block_trace import meta_copy
from lightning_3d.policies.head_weights import HeadWeights
from lightning_3d.policies.tp_structure import split_block


class _HeadGate(nn.Module):
    """RG-LRU's gates: each feature gated by sigmoids of its head's features times that head's matrices, plus
    biases, and by a per-feature weight; reshapes by ``heads``."""

    def __init__(self, width: int = 16, heads: int = 4):
        super().__init__()
        self.heads, self.block_width = heads, width // heads
        self.input_gate_weight = nn.Parameter(torch.randn(heads, self.block_width, self.block_width))
        self.input_gate_bias = nn.Parameter(torch.randn(heads, self.block_width))
        self.recurrent_gate_weight = nn.Parameter(torch.randn(heads, self.block_width, self.block_width))
        self.recurrent_gate_bias = nn.Parameter(torch.randn(heads, self.block_width))
        self.decay = nn.Parameter(torch.randn(width))

    def forward(self, x):  # (B, T, width)
        b, t, width = x.shape
        per_head = x.reshape(b * t, self.heads, self.block_width).permute(1, 0, 2)  # (heads, B*T, block_width)
        gates = [torch.baddbmm(bias[:, None, :], per_head, weight)  # (heads, B*T, block_width)
                 for weight, bias in ((self.input_gate_weight, self.input_gate_bias),
                                      (self.recurrent_gate_weight, self.recurrent_gate_bias))]
        gate, recurrent = (torch.sigmoid(g.transpose(0, 1).reshape(b, t, width)) for g in gates)
        return x * gate * torch.sigmoid(self.decay * recurrent)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.linear_x, self.linear_y, self.linear_out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.gate = _HeadGate()

    def forward(self, x):
        h = self.norm(x)
        return x + self.linear_out(self.gate(self.linear_x(h)) * self.linear_y(h))


def _plan():
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_Block() for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=2))


def test_a_block_diagonal_per_head_projection_splits_its_weights_with_the_heads():
    root, found = _plan()
    gate = found.tp_plan["model.layers.0.gate"]
    assert isinstance(gate, HeadWeights)
    assert sorted(gate.names) == ["decay", "input_gate_bias", "input_gate_weight", "recurrent_gate_bias",
                                  "recurrent_gate_weight"]
    assert found.attribute_fixes["model.layers.0.gate"] == {"heads": 2}
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9


def test_each_rank_computes_its_heads_of_what_one_process_does():
    root, found = _plan()
    whole = root.model.layers[0].gate
    x = torch.randn(2, 3, 16)
    expected = whole(x)
    for rank in range(2):  # the gate as the plan leaves it on this rank: its heads' weights, its head count
        local = copy.deepcopy(whole)
        for name in found.tp_plan["model.layers.0.gate"].names:
            setattr(local, name, nn.Parameter(getattr(whole, name).chunk(2, 0)[rank]))
        for attribute, value in found.attribute_fixes["model.layers.0.gate"].items():
            setattr(local, attribute, value)
        torch.testing.assert_close(local(x.chunk(2, -1)[rank]), expected.chunk(2, -1)[rank])


def test_the_split_gates_are_not_taken_for_experts():
    block = _Block()
    split = split_block(meta_copy(block), (torch.zeros(1, 4, 16, device="meta"),), {}, 2)
    assert expert_banks(block) == ["gate.input_gate_weight (4, 4, 4)", "gate.recurrent_gate_weight (4, 4, 4)"]
    assert expert_banks(block, split) == []
