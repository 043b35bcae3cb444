"""Tensor-parallel shape errors are said before a block computes (issue 17 item 6), and "auto" divides the head
counts a block reshapes by, whatever their names (Meta's Llama reference naming, or one of the user's own).

One process plays tp rank 3 of 8 on PyTorch's fake process group: DTensor runs its real code, collectives do
nothing, so tp=8 shapes are checked without 8 processes. The end-to-end cases (a Trainer at tp=2, and the
same model at pp=2 x tp=2 on 4 ranks) are in faults/test_bad_configs.py."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_3d.parallel.dims import ParallelDims, RankCoords
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.shape_check import ShardedShapeError, check_shapes_at_first_call
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.base import PlanOptions

TP = 8


class MetaStyleAttention(nn.Module):
    """Attention as Meta's Llama reference and torchtitan write it: wq/wk/wv/wo, head counts in n_heads and
    n_kv_heads, a per-head size in head_dim; ``heads_attribute`` renames n_heads (to one "auto" cannot know)."""

    def __init__(self, dim: int = 64, n_heads: int = 8, n_kv_heads: int = 8, heads_attribute: str = "n_heads"):
        super().__init__()
        self.heads_attribute = heads_attribute
        setattr(self, heads_attribute, n_heads)
        self.n_kv_heads, self.head_dim = n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.inputs: list[str] = []  # the kind of tensor each call got (a list: the check restores attributes)

    def forward(self, x, freqs):  # an extra input, as the rotary table of the reference code
        self.inputs.append(type(x.to_local() if isinstance(x, DTensor) else x).__name__)
        B, T, _ = x.shape
        heads = getattr(self, self.heads_attribute)
        q = self.wq(x).view(B, T, heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k, v = (w(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        k, v = (t.repeat_interleave(heads // self.n_kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q * freqs, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    def __init__(self, **attention):
        super().__init__()
        self.attention_norm = nn.RMSNorm(64)
        self.attention = MetaStyleAttention(**attention)

    def forward(self, x, freqs):
        return x + self.attention(self.attention_norm(x), freqs)


class Transformer(nn.Module):
    def __init__(self, **attention):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(**attention) for _ in range(2))

    def forward(self, x):
        freqs = torch.ones(x.shape[1], 8)
        for layer in self.layers:
            x = layer(x, freqs)
        return x


@pytest.fixture
def tp_mesh():
    """Rank 3 of a fake tp group of TP; conftest's each_test_starts_without_a_process_group ends it after the test."""
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=TP)
    return init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))


def sharded(model: nn.Module, tp_mesh, fixes: bool = True):
    plan = AutoPolicy().plan(model, PlanOptions(tp=TP))
    if not fixes:  # a hand-written plan that forgot the head count
        plan.attribute_fixes = {}
    apply_tensor_parallel(model, plan, tp_mesh)
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=TP), world_size=TP)
    check_shapes_at_first_call(model, plan, dims, RankCoords(dp=0, pp=0, tp=3))
    return model


def test_auto_divides_the_head_counts_the_block_reshapes_by_under_any_name_and_keeps_head_dim():
    plan = AutoPolicy().plan(Transformer(n_kv_heads=8), PlanOptions(tp=TP))
    assert plan.attribute_fixes["layers.0.attention"] == {"n_heads": 1, "n_kv_heads": 1}
    for name in ("n_local_heads", "heads"):  # found from the reshape the block does, not from a list of names
        plan = AutoPolicy().plan(Transformer(heads_attribute=name), PlanOptions(tp=2))
        assert plan.attribute_fixes["layers.1.attention"] == {name: 4, "n_kv_heads": 4}


@pytest.mark.parametrize("heads_attribute", ["n_heads", "heads"])
def test_a_meta_llama_style_model_runs_at_tp8(tp_mesh, heads_attribute):
    model = sharded(Transformer(heads_attribute=heads_attribute), tp_mesh)
    for _ in range(2):  # the check runs once; nothing it did stays behind
        assert model(torch.randn(16, 31, 64)).shape == (16, 31, 64)
    attention = model.layers[0].attention
    assert attention.inputs == ["FakeTensor", "Tensor", "Tensor"]  # the check, then the two real calls
    assert not any(isinstance(t, torch._subclasses.FakeTensor) for t in [*vars(attention).values(), *attention.parameters()])


def test_a_head_count_the_plan_did_not_divide_fails_before_the_block_computes_naming_module_layout_and_sizes(tp_mesh):
    model = sharded(Transformer(heads_attribute="heads"), tp_mesh, fixes=False)
    with pytest.raises(ShardedShapeError) as caught:
        model(torch.randn(16, 31, 64))
    message = str(caught.value)
    for fragment in ["layers.0.attention (MetaStyleAttention)", "(dp, pp, tp) = (1, 1, 8)", "tp=3",
                     "shape '[16, 31, 8, 8]' is invalid", "wq 64 -> 8 (of 64 -> 64)", "wo 8 -> 64",
                     "heads=8", "head_dim=8", "attribute_fixes"]:
        assert fragment in message, (fragment, message)
    assert model.layers[0].attention.inputs == ["FakeTensor"]  # the real forward never started
