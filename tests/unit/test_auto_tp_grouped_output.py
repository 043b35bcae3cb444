"""policy="auto" at tp on multi-query attention with a grouped low-rank output (DeepSeek-V4): one key/value head
that every query head reads, a compressor of it whose windows are longer than the traced sequence, and an
``nn.Linear`` subclass that applies one matrix per group of heads by a batched product of its weight. The trace
follows the heads' features through that product, so its weight splits with the heads' groups, and the group
count the block reshapes by is divided; the key/value head, its norm and the compressor stay whole."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.head_weights import HeadWeights
from lightning_3d.policies.projections import ColumnSplit, RowSplit, SummedGradients

HIDDEN, HEADS, HEAD_DIM, GROUPS, GROUP_RANK, WINDOW, TP = 16, 4, 6, 2, 5, 8, 2


class _GroupedLinear(nn.Linear):
    """One matrix per group of heads, applied by one batched product (DeepSeek-V4's ``o_a_proj``)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x):  # (B, T, groups, in_per_group)
        lead, width = x.shape[:-2], x.shape[-1]
        weight = self.weight.view(self.groups, -1, width).transpose(1, 2)  # (groups, in_per_group, out / groups)
        y = torch.bmm(x.reshape(-1, self.groups, width).transpose(0, 1), weight)  # (groups, B*T, out / groups)
        return y.transpose(0, 1).reshape(*lead, -1)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_groups, self.o_groups = HEADS, GROUPS  # (the query heads one kv head serves; the output's groups)
        self.q_a_proj, self.q_a_norm = nn.Linear(HIDDEN, 8, bias=False), nn.RMSNorm(8)
        self.q_b_proj = nn.Linear(8, HEADS * HEAD_DIM, bias=False)
        self.kv_proj, self.kv_norm = nn.Linear(HIDDEN, HEAD_DIM, bias=False), nn.RMSNorm(HEAD_DIM)
        self.compress = nn.Linear(HIDDEN, HEAD_DIM, bias=False)
        self.o_a_proj = _GroupedLinear(HEADS * HEAD_DIM // GROUPS, GROUPS * GROUP_RANK, GROUPS)
        self.o_b_proj = nn.Linear(GROUPS * GROUP_RANK, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(b, t, -1, HEAD_DIM).transpose(1, 2)  # (B, H, T, D)
        kv = self.kv_norm(self.kv_proj(x)).view(b, 1, t, HEAD_DIM)  # (B, 1, T, D): keys are values
        windows = self.compress(x)[:, : t // WINDOW * WINDOW]  # one entry per whole window: none at 4 tokens
        if windows.shape[1]:
            compressed = windows.view(b, -1, WINDOW, HEAD_DIM).mean(2)
        else:
            compressed = windows.new_zeros(b, 0, HEAD_DIM)
        kv = torch.cat([kv, compressed.unsqueeze(1)], dim=2).repeat(1, self.kv_groups, 1, 1)  # (B, H, T + C, D)
        probs = torch.softmax(q @ kv.transpose(-1, -2) * HEAD_DIM**-0.5, dim=-1)
        out = (probs @ kv).transpose(1, 2).reshape(b, t, self.o_groups, -1)  # (B, T, groups, H * D / groups)
        return self.o_b_proj(self.o_a_proj(out))


class _Mix(nn.Module):
    """Two halves of the stream mixed by weights the stream gives (as a hyper-connection mixes its streams): a
    product of the stream, not of attention scores."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, HIDDEN))

    def forward(self, h):
        b, t, _ = h.shape
        comb = torch.softmax(F.linear(h, self.weight).view(b, t, 2, 2), dim=-1)
        return torch.matmul(comb, h.view(b, t, 2, HIDDEN // 2)).reshape(b, t, HIDDEN)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mix = nn.RMSNorm(HIDDEN), _Attention(), _Mix()

    def forward(self, x):
        return self.mix(x + self.attn(self.norm(x)))


def _plan():
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_Block() for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=TP, allow_replicated=True))  # (the mixing weights: 7%)


def test_a_grouped_output_projection_splits_its_weight_with_the_groups_of_heads():
    root, found = _plan()
    plan, attn = found.tp_plan, "model.layers.0.attn"
    assert isinstance(plan[f"{attn}.o_a_proj"], HeadWeights) and plan[f"{attn}.o_a_proj"].names == ["weight"]
    assert isinstance(plan[f"{attn}.o_b_proj"], RowSplit)
    assert plan[f"{attn}.q_b_proj"].parts == (HEADS * HEAD_DIM,) and not any(plan[f"{attn}.q_b_proj"].whole)
    assert plan[f"{attn}.kv_proj"].whole == (True,)  # the one key/value head, on every rank
    for whole in ("kv_norm", "compress"):  # on it, or feeding it past the traced tokens: whole, gradients summed
        assert isinstance(plan[f"{attn}.{whole}"], SummedGradients)
    assert isinstance(plan[f"{attn}.q_a_proj"], ColumnSplit) and plan[f"{attn}.q_a_proj"].gather_output
    assert found.attribute_fixes[attn] == {"kv_groups": HEADS // TP, "o_groups": GROUPS // TP}
    assert found.attribute_fixes[f"{attn}.o_a_proj"] == {"groups": GROUPS // TP}
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.6  # (q_a_proj and the mixing weights whole)


def test_the_ranks_outputs_sum_to_what_one_process_computes():
    root, found = _plan()
    whole = root.model.layers[0].attn
    x = torch.randn(2, 2 * WINDOW, HIDDEN)  # two windows: the compressed entries take part
    expected = whole(x)
    total = 0
    for rank in range(TP):  # the attention as the plan leaves it on this rank: its heads, groups, fixes
        local = copy.deepcopy(whole)
        local.q_b_proj.weight = nn.Parameter(whole.q_b_proj.weight.chunk(TP, 0)[rank])
        local.o_a_proj.weight = nn.Parameter(whole.o_a_proj.weight.chunk(TP, 0)[rank])
        local.o_b_proj.weight = nn.Parameter(whole.o_b_proj.weight.chunk(TP, 1)[rank])
        for holder, fixes in found.attribute_fixes.items():
            if holder.startswith("model.layers.0.attn"):
                for attribute, value in fixes.items():
                    setattr(local.get_submodule(holder[len("model.layers.0.attn."):]), attribute, value)
        total = total + local(x)
    torch.testing.assert_close(total, expected)
