"""policy="auto" at tp searches the per-rank values of a block's integer attributes (and config values) among
those its forward reads: a size the block holds but never computes with (a cache length, a layer count, the
``out_features`` nn.Linear keeps) costs no trace. Here: what is recorded as read, that the modules and configs get
their classes back, and how many ranks' traces the search runs, in one process at tp=2."""

import torch
from torch import nn

from lightning_3d.policies import PlanOptions
from lightning_3d.policies import tp_per_rank
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.read_sizes import attribute_reads


class Config:
    """A config as transformers writes one: ``n_head`` an alias of ``num_attention_heads``."""

    attribute_map = {"n_head": "num_attention_heads"}

    def __init__(self) -> None:
        self.num_attention_heads = 4
        self.max_position_embeddings = 32  # never read in forward, and a size tp=2 divides
        self.num_hidden_layers = 4  # the same

    def __getattribute__(self, name):
        if name != "attribute_map" and name in type(self).attribute_map:
            name = type(self).attribute_map[name]
        return super().__getattribute__(name)


class Attention(nn.Module):
    def __init__(self, config: Config, n_embd: int) -> None:
        super().__init__()
        self.config = config
        self.max_len, self.cache_slots, self.spare = 32, 4, 16  # held, never read in forward
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.o_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        heads = self.config.n_head  # read through the alias
        q, k, v = (p(x).view(B, T, heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, config: Config, n_embd: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n_embd)
        self.self_attn = Attention(config, n_embd)

    def forward(self, x):
        return x + self.self_attn(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, n_embd: int = 32) -> None:
        super().__init__()
        config = Config()
        self.embed = nn.Embedding(vocab, n_embd)
        self.layers = nn.ModuleList(Block(config, n_embd) for _ in range(2))
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def test_the_attributes_read_in_forward_are_recorded_and_the_classes_restored():
    with torch.device("meta"):
        block = Block(Config(), 32)
    config = block.self_attn.config
    with attribute_reads(block) as reads:
        block(torch.zeros(1, 4, 32, device="meta"))
    assert "num_attention_heads" in reads["self_attn.config"] and "n_head" in reads["self_attn.config"]
    assert "max_position_embeddings" not in reads["self_attn.config"]
    assert not {"max_len", "cache_slots", "spare"} & reads["self_attn"]
    assert "out_features" not in reads["self_attn.q_proj"] and "weight" in reads["self_attn.q_proj"]
    assert type(block.self_attn) is Attention and type(config) is Config and type(block.self_attn.q_proj) is nn.Linear


def test_the_per_rank_search_traces_no_value_the_forward_does_not_read(monkeypatch):
    traced = []
    check = tp_per_rank._check_rank

    def counted(block, args, kwargs, whole, region, fixes, rank, tp):
        traced.append(fixes)
        return check(block, args, kwargs, whole, region, fixes, rank, tp)

    monkeypatch.setattr(tp_per_rank, "_check_rank", counted)
    with torch.device("meta"):
        root = nn.ModuleDict({"model": TinyLM()})
    plan = AutoPolicy().plan(root, PlanOptions(tp=2))
    fixed = {fqn: {name: vars(value) if name == "config" else value for name, value in values.items()}
             for fqn, values in plan.attribute_fixes.items()}
    assert fixed == {f"model.layers.{i}.self_attn": {"config": dict(vars(Config()), num_attention_heads=2)}
                     for i in range(2)}
    # as it is (fails: 4 heads of 4 features on 16), then the heads halved, on ranks 0 and 1; with the unread
    # sizes among the candidates, 6 (their subsets are tried before a config value)
    assert len(traced) == 3, traced
