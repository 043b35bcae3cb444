"""policy="auto" at tp splits a plain module holding a stacked up and down projection (experts first, no
transformers flags: Llama 4's experts) per expert by its intermediate features, once the sum of its forward over
each rank's slice is checked to be the whole forward; a forward that is not linear in them is left whole, named."""

import pytest
import torch
from torch import nn

from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.experts import ExpertsLayout, ExpertsSplit

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 32, 16, 4, 2


class StackedExperts(nn.Module):
    """Each token's chosen experts, written for one device: up (E, H, 2I) as [gate | up] halves, down (E, I, H)."""

    def __init__(self, norm_each_output: bool = False):
        super().__init__()
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE))
        self.down = nn.Parameter(torch.randn(EXPERTS, INTERMEDIATE, HIDDEN))
        self.norm_each_output = norm_each_output

    def forward(self, x, chosen, weights):  # x (T, H), chosen and weights (T, k)
        out = torch.zeros_like(x)
        for slot in range(chosen.shape[1]):
            gate, up = torch.einsum("th,thi->ti", x, self.up[chosen[:, slot]]).chunk(2, dim=-1)
            y = torch.einsum("ti,tih->th", nn.functional.silu(gate) * up, self.down[chosen[:, slot]])
            if self.norm_each_output:  # a norm over each expert's output: not linear in its intermediate features
                y = nn.functional.normalize(y, dim=-1)
            out = out + y * weights[:, slot, None]
        return out


class MoE(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = StackedExperts(**kwargs)

    def forward(self, x):  # (B, T, H)
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = self.router(flat).softmax(-1).topk(TOP_K, dim=-1)
        return x + self.experts(flat, chosen, weights).view_as(x)


def _model(**kwargs):
    with torch.device("meta"):
        return nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(MoE(**kwargs) for _ in range(2))})})


def test_stacked_experts_are_split_per_expert_by_their_checked_layout():
    root = _model()
    found = AutoPolicy().plan(root, PlanOptions(tp=2))
    style = found.tp_plan["model.layers.0.experts"]
    assert isinstance(style, ExpertsSplit)
    assert style.layout == ExpertsLayout(up="up", up_dim=2, halves=True, down_dim=1, bias=False, down="down")
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95  # all but the router


def test_stacked_experts_not_linear_in_their_intermediate_features_are_refused_naming_them():
    with pytest.raises(PolicyError, match=r"experts: the experts module StackedExperts\.forward is not the sum of its"
                                          r" forwards on each tp rank's slice"):
        AutoPolicy().plan(_model(norm_each_output=True), PlanOptions(tp=2))
