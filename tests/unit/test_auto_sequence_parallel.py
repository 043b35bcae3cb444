"""Sequence parallelism from policy="auto" for a model no policy was written for (issue 17 item 7).

The model is the user's nanoGPT (helpers/user_models.py: blocks in a ModuleList, ln_1/ln_2, attention q/k/v/c_proj,
MLP c_fc/c_proj, tied embedding and head). "auto" finds its norms by structure and keeps the hidden states split
along the sequence between the attention and the MLP (the runs that match one process:
parity/test_parity_auto_sequence_parallel.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from helpers.user_models import LlamaStyleLM, NanoGPT
from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.hidden_states import HiddenStates
from lightning_3d.policies.projections import ColumnSplit

SP = PlanOptions(tp=2, sequence_parallel=True)


def test_auto_keeps_nanogpts_hidden_states_split_along_the_sequence_between_attention_and_mlp():
    plan = AutoPolicy().plan(nn.ModuleDict({"model": NanoGPT(64, 16, 3, 32, 4)}), SP)
    styles = {fqn: style for fqn, style in plan.tp_plan.items() if fqn.startswith("model.h.1.")}
    assert {fqn for fqn, s in styles.items() if isinstance(s, SequenceParallel)} == {"model.h.1.ln_1", "model.h.1.ln_2"}
    for region, out in (("attn", "c_proj"), ("mlp", "c_proj")):
        assert styles[f"model.h.1.{region}"].input == (Shard(1), Replicate())  # all-gathered entering
        assert styles[f"model.h.1.{region}.{out}"].output_layouts == (Shard(1),)  # reduce-scattered leaving
    assert all(isinstance(styles[f"model.h.1.attn.{n}"], ColwiseParallel) for n in "qkv")
    assert isinstance(styles["model.h.1.attn.c_proj"], RowwiseParallel)
    assert plan.attribute_fixes["model.h.1.attn"] == {"n_head": 2}
    # Cut entering the first block, gathered leaving the last: ln_f and the tied head see every position.
    first, last = plan.tp_plan["model.h.0"], plan.tp_plan["model.h.2"]
    assert isinstance(first, HiddenStates) and first.input == (Replicate(), Shard(1)) and first.output is None
    assert isinstance(last, HiddenStates) and last.output == (Shard(1), Replicate()) and last.input is None
    assert not any(fqn.startswith("model.ln_f") for fqn in plan.tp_plan)
    # ... and the tied embedding and head split over the vocabulary on every position (issue 29).
    assert plan.tp_plan["model.lm_head"].input_layouts == (Replicate(),)
    assert isinstance(plan.tp_plan["model.wte"], RowwiseParallel)


def test_auto_splits_an_mlp_whose_projections_sit_on_the_block_itself_and_keeps_sp_around_it():
    # Meta-Llama layout: the feed-forward's w1/w2/w3 are the block's own children, beside the norms; the trace
    # finds them as a region (w1, w3 -> w2) all the same, each column gathering its own input.
    plan = AutoPolicy().plan(nn.ModuleDict({"model": LlamaStyleLM(64, 2, 32, 4)}), SP)
    styles = plan.tp_plan
    for column in ("w1", "w3"):
        assert isinstance(styles[f"model.layers.1.{column}"], ColumnSplit)
        assert styles[f"model.layers.1.{column}"].input_layouts == (Shard(1),)
    assert styles["model.layers.1.w2"].output_layouts == (Shard(1),)
    assert {f for f, st in styles.items() if isinstance(st, SequenceParallel) and f.startswith("model.layers.1.")} == {
        "model.layers.1.attention_norm", "model.layers.1.ffn_norm"}


class LayerScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class ScaledBlock(nn.Module):
    """A pre-norm MLP block whose output is scaled by a learned vector before the residual add (CaiT, DINOv2)."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.up, self.down, self.scale = nn.LayerNorm(dim), nn.Linear(dim, 64), nn.Linear(64, dim), LayerScale(dim)

    def forward(self, x):
        return x + self.scale(self.down(F.gelu(self.up(self.norm(x)))))


def test_auto_refuses_sequence_parallel_for_weights_between_the_regions_it_found():
    # The layer scale's weight would see this rank's positions only on a sequence shard.
    model = nn.ModuleDict({"model": nn.Sequential(*[ScaledBlock() for _ in range(2)])})
    with pytest.raises(PolicyError, match=r"cannot keep the hidden states of model.0 split along the"
                                          r" sequence.*model.0.scale \(LayerScale\).*sequence_parallel=False"):
        AutoPolicy().plan(model, SP)
