"""policy="auto" at tp on a block's own weights of one value per split feature (nGPT's scales, RWKV's decay),
split with the features their elements meet, and on reductions over split features: a norm module without
weights runs on a DTensor of the rank's share; a reduction written inline is refused, named."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.head_weights import HeadWeights
from lightning_3d.policies.projections import OnSplitFeatures


class _UnitNorm(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1)


class _ScaledBlock(nn.Module):
    """An MLP whose up features the block scales, one weight per feature (``flipped``: feature f by weight
    31 - f, so each rank's features would meet the other rank's weights), then normed over all of them (a
    module without weights, or ``inline`` in the forward) before the down projection."""

    def __init__(self, flipped: bool = False, inline: bool = False):
        super().__init__()
        self.flipped, self.inline = flipped, inline
        self.norm, self.sub_norm = nn.LayerNorm(16), _UnitNorm()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x):
        h = self.up(self.norm(x)) * (self.scale.flip(0) if self.flipped else self.scale)
        return x + self.down(F.normalize(h, dim=-1) if self.inline else self.sub_norm(h))


def _plan(**kwargs):
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_ScaledBlock(**kwargs) for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=2))


def test_a_weight_of_one_value_per_split_feature_splits_with_them_and_a_norm_over_them_sees_all():
    root, found = _plan()
    block = found.tp_plan["model.layers.0"]
    assert isinstance(block, HeadWeights) and block.names == ["scale"]
    # The norm over all 32 up features: on each rank a DTensor of its 16, which DTensor reduces over both.
    assert isinstance(found.tp_plan["model.layers.0.sub_norm"], OnSplitFeatures)
    assert found.tp_plan["model.layers.0.sub_norm"].dim == 2
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9


def test_a_weight_whose_elements_meet_another_ranks_features_is_not_split():
    with pytest.raises(PolicyError, match="does not compute what one process does"):
        _plan(flipped=True)


def test_a_reduction_over_split_features_written_inline_is_refused_naming_it():
    with pytest.raises(PolicyError, match="reduces over features of up that the split puts on different ranks"):
        _plan(inline=True)
