"""A grouped convolution over ``[q | k]``, one group per head (ZAYA's compressed convolutional attention): its
features are followed through the padding and the groups, its filters split with the heads; values made of
two projections the kv heads cut unevenly; a per-kv-head key scale in a module of its own taking q and k."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.block_trace import meta_copy, trace_block
from lightning_3d.policies.head_weights import HeadWeights

HEADS, KV_HEADS, HEAD_DIM, WIDTH = 4, 2, 8, 32


class KeyScale(nn.Module):
    """One learned scale per kv head of the keys; the queries pass through."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(KV_HEADS))

    def forward(self, q, k):
        return q, k * self.scale[None, None, :, None]


class Attention(nn.Module):
    def __init__(self, groups: int = HEADS + KV_HEADS):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM)
        self.v_now = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM // 2)  # the first kv heads' values
        self.v_before = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM // 2)  # the others', a token late
        channels = (HEADS + KV_HEADS) * HEAD_DIM
        self.conv = nn.Conv1d(channels, channels, 2, groups=groups)
        self.key_scale = KeyScale()
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q, k = self.q_proj(h), self.k_proj(h)
        qk = self.conv(F.pad(torch.cat([q, k], -1).transpose(1, 2), (1, 0))).transpose(1, 2)  # causal
        n = q.shape[-1]
        q, k = (qk[..., :n] + q).view(b, t, -1, HEAD_DIM), (qk[..., n:] + k).view(b, t, -1, HEAD_DIM)
        q, k = self.key_scale(q, k)
        first = self.v_before(h.new_zeros(b, 1, WIDTH))  # before the first token: the bias
        v = torch.cat([self.v_now(h), torch.cat([first, self.v_before(h)[:, :-1]], 1)], -1)
        v = v.view(b, t, -1, HEAD_DIM)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        return x + self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _layers(**kwargs) -> nn.Module:
    return nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(Attention(**kwargs) for _ in range(2))})})


def test_features_are_followed_through_the_padding_and_the_groups_of_a_grouped_convolution():
    trace = trace_block(meta_copy(Attention()), (torch.zeros(1, 4, WIDTH, device="meta"),), {})
    channels = trace.depthwise["conv"]  # per output channel: the features of its group's input channels
    assert channels[0] == {"q_proj": frozenset(range(HEAD_DIM)), "k_proj": frozenset()}
    assert channels[HEADS * HEAD_DIM] == {"q_proj": frozenset(), "k_proj": frozenset(range(HEAD_DIM))}
    assert trace.attention[0].q[1]["q_proj"] == frozenset(range(HEAD_DIM, 2 * HEAD_DIM))


def test_a_grouped_convolution_of_one_group_per_head_splits_with_the_heads():
    root = _layers()
    found = AutoPolicy().plan(root, PlanOptions(tp=2))
    style = found.tp_plan["model.layers.0"]
    assert isinstance(style, HeadWeights) and style.names == ["conv.weight", "conv.bias"]
    assert style.parts == {"conv.weight": (32, 16), "conv.bias": (32, 16)}  # this rank's q heads, its kv head
    assert found.attribute_fixes["model.layers.0.conv"] == {"groups": 3}
    # the kv heads cut the values unevenly: rank 0's are v_now's, rank 1's v_before's
    assert found.tp_plan["model.layers.0.v_now"].picked == (tuple(range(8)), ())
    assert found.tp_plan["model.layers.0.v_before"].picked == ((), tuple(range(8)))
    assert found.tp_plan["model.layers.0.key_scale"].dim == 2  # run on the split q and k, its scale whole
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.8  # the values whole on every rank (by design), the norm, the key scale


def test_a_grouped_convolution_whose_groups_mix_the_ranks_heads_is_not_split():
    # 3 groups of 16 channels: every key then holds both kv heads' features, which no rank's share computes
    with pytest.raises(PolicyError, match=r"split over tp it does not compute what one process does"):
        AutoPolicy().plan(_layers(groups=3), PlanOptions(tp=2))
