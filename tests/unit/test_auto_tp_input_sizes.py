"""policy="auto" at tp on attention that reads its width off its input (issue 52): ``B, T, C = x.size()``, then
``reshape(B, T, C)`` (TrOCR's and nanoGPT's attention). Such a module gets each rank's slice of the hidden
features and its columns gather them back, also when the block hands it the hidden states by keyword
(``self_attn(hidden_states=...)``). Here: the plan only, in one process, at tp=2."""

import torch
from torch import nn
from torch.distributed.tensor import Shard

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.hidden_states import HiddenStates
from lightning_3d.policies.projections import ColumnSplit, RowSplit


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.out_proj = nn.Linear(n_embd, n_embd)

    def forward(self, hidden_states):
        B, T, C = hidden_states.size()  # C: the width as it comes in, not the heads' features
        q, k, v = (p(hidden_states).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v  # (B, nh, T, hs)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, keyword: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n_embd)
        self.self_attn = Attention(n_embd, n_head)
        self.keyword = keyword

    def forward(self, x):  # (B, T, C)
        h = self.norm(x)
        return x + (self.self_attn(hidden_states=h) if self.keyword else self.self_attn(h))


class TinyLM(nn.Module):
    def __init__(self, keyword: bool, vocab: int = 64, n_embd: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n_embd)
        self.layers = nn.ModuleList(Block(n_embd, n_head, keyword) for _ in range(2))
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, ids):  # (B, T)
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def plan(keyword: bool):
    with torch.device("meta"):
        root = nn.ModuleDict({"model": TinyLM(keyword)})
    return AutoPolicy().plan(root, PlanOptions(tp=2))


def _assert_narrowed(found) -> None:
    attn = "model.layers.0.self_attn"
    assert isinstance(found.tp_plan[attn], HiddenStates) and found.tp_plan[attn].input[1] == Shard(-1)
    for name in ("q_proj", "k_proj", "v_proj"):
        style = found.tp_plan[f"{attn}.{name}"]
        assert isinstance(style, ColumnSplit) and style.input_layouts == (Shard(-1),)
    assert isinstance(found.tp_plan[f"{attn}.out_proj"], RowSplit)
    assert found.attribute_fixes["model.layers.0.self_attn"] == {"n_head": 2}


def test_attention_reading_its_width_off_its_input_gets_each_ranks_features():
    _assert_narrowed(plan(keyword=False))


def test_hidden_states_passed_by_keyword_are_narrowed_too():
    _assert_narrowed(plan(keyword=True))
