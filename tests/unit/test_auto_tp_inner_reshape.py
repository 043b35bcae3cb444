"""policy="auto" at tp on a module inside a split region whose output does not keep its input's shape (xLSTM's
multi-head norm: it needs all heads, and flattens them into features): traced per rank as the ranks run it, on
a DTensor of the whole shape, with its output cut back to the rank's share."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.projections import ColumnSplit, OnSplitFeatures, RowSplit

HEADS, HEAD_DIM, WIDTH = 4, 8, 16


class _HeadNorm(nn.Module):
    """Each head normed over its features, the heads flattened into features, one weight per feature."""

    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.weight = nn.Parameter(torch.randn(HEADS * HEAD_DIM))

    def forward(self, x):  # (B, T, heads, head_dim)
        b, t, heads, head_dim = x.shape
        if heads != self.heads:
            raise ValueError(f"expected {self.heads} heads, got {heads}")
        return F.layer_norm(x, (head_dim,)).reshape(b, t, heads * head_dim) * self.weight  # (B, T, heads * head_dim)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, WIDTH)
        self.head_norm = _HeadNorm()

    def forward(self, x):  # (B, T, width)
        b, t, _ = x.shape
        heads = self.up(self.norm(x)).view(b, t, -1, HEAD_DIM)  # (B, T, heads, head_dim)
        return x + self.down(self.head_norm(heads))


def _plan():
    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_Block() for _ in range(2))})})
    return root, AutoPolicy().plan(root, PlanOptions(tp=2))


def test_a_norm_that_needs_all_heads_and_flattens_them_runs_on_the_split_heads():
    _, found = _plan()
    assert isinstance(found.tp_plan["model.layers.0.up"], ColumnSplit)
    assert isinstance(found.tp_plan["model.layers.0.down"], RowSplit)
    style = found.tp_plan["model.layers.0.head_norm"]
    assert isinstance(style, OnSplitFeatures) and style.dim == 2  # (B, T, heads, head_dim)


def test_on_a_rank_it_gives_that_ranks_features_as_the_row_reads_them():
    root, found = _plan()
    whole = root.model.layers[0].head_norm
    x = torch.randn(2, 3, HEADS, HEAD_DIM)
    expected = whole(x)
    rank = 1  # of a fake tp group of 2: DTensor runs its real code; this norm needs no collective
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    # A mesh unequal to other tests' rank-0 meshes in this process: DTensor caches local shapes and offsets per
    # equal mesh, whatever rank made it.
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp_rank1",))
    local = found.tp_plan["model.layers.0.head_norm"]._apply(copy.deepcopy(whole), mesh)
    got = local(x.chunk(2, dim=2)[rank])
    torch.testing.assert_close(got, expected.chunk(2, dim=-1)[rank])  # the row's input features of this rank
