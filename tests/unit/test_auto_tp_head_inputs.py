"""policy="auto" at tp on a per-head input the model computes once and hands every block with its heads on the
second dimension: CPM-Ant's position bias, ``(batch, heads, q, k)``, looked up in a learned table of one
column per head and added to the attention scores. Each rank's blocks get its heads' slice; the shrunk block's
trace follows each element of the cut input to the scores, so a cut that would hand a head another head's bias
is refused. Here: the plan only, in one process, at tp=2 (the gradient of the table, summed over tp, is the
census' cpmant case at tp2)."""

import pytest
import torch
from torch import nn

from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.head_inputs import HeadInputs, cut

HEADS, WIDTH, BUCKETS = 4, 32, 8


class Attention(nn.Module):
    def __init__(self, reorder: str | None) -> None:
        super().__init__()
        self.num_heads, self.reorder = HEADS, reorder
        self.project_q, self.project_k, self.project_v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.attention_out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x, mask, position_bias):  # x (B, T, C), mask (B, T, T), position_bias (B, heads, T, T)
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).permute(0, 2, 1, 3)  # (B, heads, T, head_dim)
                   for p in (self.project_q, self.project_k, self.project_v))
        bias = position_bias
        if self.reorder == "interleaved":  # head h reads the bias of head 2h (first half) or 2h - heads + 1
            bias = bias.unflatten(1, (2, -1)).transpose(1, 2).flatten(1, 2)
        elif self.reorder == "flipped":  # head h reads that of head heads - 1 - h, by an op the trace cannot follow
            bias = bias.flip(1)
        score = q @ k.transpose(-1, -2) + bias  # (B, heads, T, T)
        score = torch.masked_fill(score, mask.view(b, 1, t, t) == torch.tensor(False), torch.scalar_tensor(-1e4))
        y = torch.softmax(score, dim=-1) @ v  # (B, heads, T, head_dim)
        return self.attention_out(y.permute(0, 2, 1, 3).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, reorder: str | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = Attention(reorder)

    def forward(self, x, mask, position_bias):
        return x + self.attention(self.norm(x), mask, position_bias)


class TinyLM(nn.Module):
    def __init__(self, reorder: str | None = None, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.relative_attention_bias = nn.Parameter(torch.randn(BUCKETS, HEADS))  # one column per head
        self.layers = nn.ModuleList(Block(reorder) for _ in range(2))
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, ids):  # (B, T)
        t = ids.shape[1]
        positions = torch.arange(t)
        buckets = (positions[None, :] - positions[:, None]).clamp(-BUCKETS // 2, BUCKETS // 2 - 1) + BUCKETS // 2
        position_bias = self.relative_attention_bias[buckets].permute(2, 0, 1)[None]  # (1, heads, T, T)
        mask = (positions[None, :] <= positions[:, None])[None].expand(ids.shape[0], t, t)  # (B, T, T)
        x = self.embed(ids)
        for block in self.layers:
            x = block(x, mask, position_bias)
        return self.head(x)


def plan(reorder: str | None = None):
    with torch.device("meta"):
        root = nn.ModuleDict({"model": TinyLM(reorder)})
    return AutoPolicy().plan(root, PlanOptions(tp=2))


def test_a_position_bias_with_its_heads_on_the_second_dimension_is_cut_to_each_ranks_heads():
    found = plan()
    style = found.tp_plan["model.layers.0"]
    assert isinstance(style, HeadInputs) and style.keys == [("arg", 2, 1)] and style.heads == HEADS
    assert found.attribute_fixes["model.layers.0.attention"] == {"num_heads": 2}
    bias = torch.arange(2 * HEADS * 3 * 3.0).reshape(2, HEADS, 3, 3)  # batch 2
    args, _ = cut((None, None, bias), {}, style.keys, heads=HEADS, rank=1, tp=2)
    torch.testing.assert_close(args[2], bias[:, 2:])


def test_a_cut_that_hands_a_head_another_heads_bias_is_refused():
    # The block interleaves the heads of its bias: the whole block's head 1 adds head 2's bias; cut to rank 0's
    # heads 0 and 1, its head 1 would add head 1's. The shapes agree; the elements reaching the scores do not.
    with pytest.raises(PolicyError, match="its heads would add to their scores other elements of the block's"
                                          " argument 2"):
        plan("interleaved")


def test_a_cut_whose_way_to_the_scores_the_trace_cannot_follow_is_refused():
    with pytest.raises(PolicyError, match="the block's argument 2 reaches not every attention head"):
        plan("flipped")
