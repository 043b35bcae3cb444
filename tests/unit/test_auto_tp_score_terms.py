"""policy="auto" at tp on an attention that adds to each head's scores terms projections compute from the hidden
states (Inkling's): a relative position bias (per-head states that mix a bank of bias-vs-distance profiles,
gathered by distance) and attention sinks (one logit per head, beside the scores in the softmax). Both
projections split with the heads; the bank, which every head mixes, stays whole on every rank, runs on that
rank's heads and has its gradient summed over tp."""

import copy

import torch
from torch import nn

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.projections import ColumnSplit, SummedGradients

HIDDEN, HEADS, HEAD_DIM, D_REL, EXTENT, TP = 16, 4, 4, 3, 5, 2


class _RelativeBias(nn.Module):
    """Inkling's relative logits: a bank of profiles (d_rel, extent), gathered by distance."""

    def __init__(self):
        super().__init__()
        self.bank = nn.Parameter(torch.randn(D_REL, EXTENT))

    def forward(self, states, positions):  # (B, T, heads, d_rel) -> (B, heads, T, T)
        logits = (states @ self.bank).transpose(1, 2)  # (B, heads, T, extent)
        distance = (positions[:, None] - positions[None, :])[None, None]
        index = distance.clamp(0, EXTENT - 1).expand(*logits.shape[:2], -1, -1)
        return logits.gather(-1, index).masked_fill((distance < 0) | (distance >= EXTENT), 0.0)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.r_proj = nn.Linear(HIDDEN, HEADS * D_REL, bias=False)
        self.sink_proj = nn.Linear(HIDDEN, HEADS, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.relative = _RelativeBias()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        bias = self.relative(self.r_proj(x).view(b, t, self.heads, D_REL), torch.arange(t))
        scores = torch.matmul(q, k.transpose(2, 3)) / HEAD_DIM ** 0.5 + bias  # (B, heads, T, T)
        sinks = self.sink_proj(x).transpose(1, 2).unsqueeze(-1)  # (B, heads, T, 1)
        weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = _Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


def _plan():
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_Block() for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=TP))


def test_projections_of_score_terms_split_with_the_heads_and_the_bank_stays_whole():
    _, found = _plan()
    plan = found.tp_plan
    for column in ("q_proj", "k_proj", "v_proj", "r_proj", "sink_proj"):
        assert isinstance(plan[f"model.layers.0.attn.{column}"], ColumnSplit), column
    bank = plan["model.layers.0.attn.relative"]
    assert isinstance(bank, SummedGradients) and bank.shared_by_heads
    assert found.attribute_fixes["model.layers.0.attn"] == {"heads": HEADS // TP}


def test_the_ranks_heads_with_their_terms_sum_to_one_process_and_so_do_the_banks_gradients():
    root, _ = _plan()
    block = root["model"]["layers"][0]
    x = torch.randn(2, 7, HIDDEN)  # 7 tokens: distances past the bank's extent too
    expected = block(x)
    expected.square().sum().backward()
    summed, bank_gradient = x.clone(), torch.zeros(D_REL, EXTENT)
    for rank in range(TP):  # the block as the plan leaves it on this rank: its heads, the whole bank
        local = copy.deepcopy(block)
        local.zero_grad()
        attn, whole = local.attn, block.attn
        heads = slice(rank * HEADS // TP, (rank + 1) * HEADS // TP)
        for name, size in (("q_proj", HEAD_DIM), ("k_proj", HEAD_DIM), ("v_proj", HEAD_DIM), ("r_proj", D_REL),
                           ("sink_proj", 1)):
            rows = getattr(whole, name).weight.view(HEADS, size, HIDDEN)[heads].reshape(-1, HIDDEN)
            getattr(attn, name).weight = nn.Parameter(rows.detach().clone())
        attn.o_proj.weight = nn.Parameter(whole.o_proj.weight.view(HIDDEN, HEADS, HEAD_DIM)[:, heads].reshape(HIDDEN, -1)
                                          .detach().clone())
        attn.heads = HEADS // TP
        share = local(x) - x
        summed = summed + share.detach()
        # this rank's share of the loss's gradient: the whole output's, reaching its heads' part of the sum
        share.backward(2 * expected.detach())
        bank_gradient += attn.relative.bank.grad
    torch.testing.assert_close(summed, expected.detach())
    torch.testing.assert_close(bank_gradient, block.attn.relative.bank.grad)
