"""policy="auto" at tp on an attention whose scores get a mask computed from its values (Doge's dynamic mask:
``dt_proj`` reads the values of every key/value head and gives one step per key/value head, scaled by ``A``,
one value per key/value head, and added at each key to the scores of that head's queries): ``dt_proj`` splits
by its inputs and each rank keeps the slice of its summed outputs its heads read (a reduce-scatter), ``A``
splits with the heads. A mask every head reads whole keeps ``dt_proj``'s outputs whole on every rank."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from lightning_3d.errors import PolicyError
from lightning_3d.policies import PlanOptions, tp_structure
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.block_trace import meta_copy, trace_block
from lightning_3d.policies.head_weights import HeadWeights
from lightning_3d.policies.projections import RowSplit

WIDTH, HEADS, KV_HEADS, TP = 16, 4, 2, 2
HEAD_DIM = WIDTH // HEADS


class _DynamicMaskAttention(nn.Module):
    """q of 4 heads, k and v of 2; the mask from all the values, per key/value head (``shared``: summed over
    them, the same for every head)."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.shared, self.groups = shared, HEADS // KV_HEADS  # query heads per key/value head
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False) for _ in range(2))
        self.dt_proj = nn.Linear(KV_HEADS * HEAD_DIM, KV_HEADS, bias=False)
        self.A = nn.Parameter(torch.randn(KV_HEADS))
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)  # (B, heads, T, hd)
        k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.k_proj, self.v_proj))  # (B, kv, T, hd)
        dt = self.dt_proj(v.transpose(1, 2).reshape(b, t, -1))  # (B, T, kv): from every kv head's values
        mask = torch.exp(self.A * F.softplus(dt)).transpose(-1, -2)[:, :, None, :]  # (B, kv, 1, T)
        if self.shared:
            mask = mask.sum(1, keepdim=True)  # (B, 1, 1, T)
        k, v, mask = (s.repeat_interleave(self.groups, 1) if s.shape[1] > 1 else s for s in (k, v, mask))
        scores = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5 + mask  # (B, heads, T, T)
        out = scores.softmax(-1) @ v  # (B, heads, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, shared: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = _DynamicMaskAttention(shared)

    def forward(self, x):
        return x + self.attn(self.norm(x))


def _plan(shared: bool = False):
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_Block(shared) for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=TP))


def test_the_trace_reads_the_mask_on_each_heads_scores_and_the_values_after_it():
    trace = trace_block(meta_copy(_Block()), (torch.zeros(1, 4, WIDTH, device="meta"),), {})
    assert len(trace.attention) == 1
    event = trace.attention[0]
    values = [frozenset(range(HEAD_DIM)), frozenset(range(HEAD_DIM, 2 * HEAD_DIM))]  # of kv heads 0 and 1
    assert [head["attn.v_proj"] for head in event.v] == [values[0]] * 2 + [values[1]] * 2
    assert [head["attn.dt_proj"] for head in event.scores] == [frozenset({0})] * 2 + [frozenset({1})] * 2
    assert [head["attn.A"] for head in event.weights] == [frozenset({0})] * 2 + [frozenset({1})] * 2


def test_the_inner_row_is_reduce_scattered_and_its_per_head_weight_split():
    root, found = _plan()
    dt_proj = found.tp_plan["model.layers.0.attn.dt_proj"]
    assert isinstance(dt_proj, RowSplit) and dt_proj.output_layouts == (Shard(-1),) and not dt_proj.summed_gradient
    attn = found.tp_plan["model.layers.0.attn"]
    assert isinstance(attn, HeadWeights) and attn.names == ["A"]
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9  # all but the norms


def _ranks_sum(shared: bool) -> None:
    """The ranks' outputs, emulated in one process with the weights as the plan leaves them on each, sum to what
    one process computes; dt_proj's partial outputs summed over the ranks, then each keeps its slice (a
    reduce-scatter) or all of them."""
    root, found = _plan(shared)
    whole = root.model.layers[0].attn
    x = torch.randn(2, 5, WIDTH)
    scattered = isinstance(found.tp_plan.get("model.layers.0.attn"), HeadWeights)
    locals_ = []
    for rank in range(TP):
        local = copy.deepcopy(whole)
        for name, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("dt_proj", 1), ("o_proj", 1)):
            projection = getattr(local, name)
            projection.weight = nn.Parameter(getattr(whole, name).weight.chunk(TP, dim)[rank])
        if scattered:
            local.A = nn.Parameter(whole.A.chunk(TP)[rank])
        locals_.append(local)
    summed = sum(local.dt_proj(local.v_proj(x)) for local in locals_)
    for rank, local in enumerate(locals_):
        local.dt_proj.forward = lambda _v, r=rank: summed.chunk(TP, -1)[r] if scattered else summed
    torch.testing.assert_close(sum(local(x) for local in locals_), whole(x))


def test_the_ranks_sum_to_what_one_process_computes():
    _ranks_sum(shared=False)


def test_a_mask_every_head_reads_keeps_the_inner_rows_outputs_whole():
    _, found = _plan(shared=True)
    dt_proj = found.tp_plan["model.layers.0.attn.dt_proj"]
    assert dt_proj.output_layouts == (Replicate(),) and dt_proj.summed_gradient
    assert not isinstance(found.tp_plan.get("model.layers.0.attn"), HeadWeights)  # A whole: every head reads all
    _ranks_sum(shared=True)


def test_a_split_whose_heads_would_read_another_heads_mask_is_refused(monkeypatch):
    # dt_proj's outputs whole on every rank: with the query heads per kv head divided, every shape fits, but the
    # second head of rank 0 would read the mask of kv head 1; the per-rank trace compares each head's mask
    monkeypatch.setattr(tp_structure, "head_slices", lambda *args: None)
    with pytest.raises(PolicyError, match="its heads would see other scores features"):
        _plan()
