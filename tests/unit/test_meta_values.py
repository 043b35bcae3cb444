"""A block traced on the meta device reads values there: of tensors made from Python data, and of a router's
choice of experts (policies/meta_values.py); a value that derives from the weights stays unread, with why."""

import pytest
import torch
from torch import nn

from lightning_3d.policies.block_inputs import SKIPPED, block_inputs
from lightning_3d.policies.block_trace import trace_block
from lightning_3d.policies.meta_values import MetaValues


class Mlp(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class SparseActivation(Mlp):
    """Gemma 3n's way: a standard normal's quantile of a sparsity constant, validated by the distribution."""

    def forward(self, x):
        h = self.up(x)
        cutoff = torch.distributions.Normal(0, 1).icdf(torch.tensor(0.95, device=x.device))
        return x + self.down(torch.relu(h - h.mean(-1, keepdim=True) - cutoff * h.std(-1, keepdim=True)))


class ExpertsCountedByRouting(nn.Module):
    """JetMoE's way: tokens sorted by their chosen expert, split by each expert's count (``.tolist()``)."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Mlp(width) for _ in range(experts))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        chosen = self.router(tokens).topk(2, dim=-1).indices.flatten()
        counts = torch.zeros(len(self.experts), dtype=torch.long).scatter_add(0, chosen, torch.ones_like(chosen))
        order = chosen.sort().indices // 2
        pieces = tokens[order].split(counts.tolist())
        out = torch.cat([expert(piece) for expert, piece in zip(self.experts, pieces)])
        return x + torch.zeros_like(tokens).index_add(0, order, out).reshape(x.shape)


class ReadsItsWeights(Mlp):
    def forward(self, x):
        return self.down(self.up(x)) if self.up(x).sum() > 0 else x


def meta_input():
    return torch.zeros(1, 4, 8, device="meta")


def test_a_tensor_made_from_python_data_keeps_its_value_on_meta():
    with torch.device("meta"), MetaValues():
        constant = torch.tensor([0.25, 0.75])
        assert constant.device.type == "meta" and (constant * 2).tolist() == [0.5, 1.5]


def test_a_block_reading_a_constant_made_inside_it_is_traced():
    with torch.device("meta"):
        block = SparseActivation()
    trace = trace_block(block, (meta_input(),), {})
    assert trace.problem is None and trace.order == ["up", "down"]


def test_a_block_that_counts_the_tokens_routed_to_each_expert_is_traced():
    with torch.device("meta"):
        block = ExpertsCountedByRouting()
    trace = trace_block(block, (meta_input(),), {})
    assert trace.problem is None, trace.problem
    assert trace.order[0] == "router" and all(f"experts.{i}.up" in trace.order for i in range(4))


def test_a_routing_choice_on_meta_is_a_valid_one_and_its_scores_stay_without_values():
    scores = torch.zeros(6, 4, device="meta")  # derived from weights: no twin
    with torch.device("meta"), MetaValues():
        values, indices = scores.topk(2, dim=-1)
        chosen = indices.tolist()
        with pytest.raises(RuntimeError, match="derives from the weights"):
            values.sum().item()
    assert all(len(set(row)) == 2 and all(0 <= i < 4 for i in row) for row in chosen)


def test_a_block_that_branches_on_its_weights_values_is_refused_saying_so():
    with torch.device("meta"):
        block = ReadsItsWeights()
    assert "derives from the weights" in trace_block(block, (meta_input(),), {}).problem


class SkipsItsLastBlock(nn.Module):
    """Mllama's way: a cross-attention layer the forward skips without images."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Mlp() for _ in range(2))

    def forward(self, ids, images=None):
        x = self.embed(ids)
        return self.layers[0](x) if images is None else self.layers[1](self.layers[0](x))


def test_a_block_the_forward_skips_is_said_to_be_skipped():
    with torch.device("meta"):
        model = SkipsItsLastBlock()
    assert not isinstance(block_inputs(model, model.layers[0], width=8), str)
    assert block_inputs(model, model.layers[1], width=8) == SKIPPED
