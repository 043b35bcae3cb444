"""policy="auto" at tp on Mamba-1 layers (Mamba, Falcon-Mamba, Jamba): the selective scan seen as attention over
channels, and the projection inside the region (``x_proj``) split by its inputs with its outputs summed."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.projections import ColumnSplit, RowSplit, SummedGradients

transformers = pytest.importorskip("transformers")


def _jamba():
    # As configured for training: no cache; 2 Mamba-1 layers and 2 attention layers, dense MLPs (one expert).
    config = transformers.AutoConfig.for_model(
        "jamba", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_experts=1, mamba_d_state=8, mamba_dt_rank=4, use_cache=False)
    with torch.device("meta"):
        return nn.ModuleDict({"model": transformers.AutoModelForCausalLM.from_config(config)})


def test_a_mamba1_layer_splits_its_channels_and_sums_x_proj_both_ways():
    root = _jamba()
    found = AutoPolicy().plan(root, PlanOptions(tp=2))
    mixer = "model.model.layers.0.mamba"
    in_proj, x_proj = found.tp_plan[f"{mixer}.in_proj"], found.tp_plan[f"{mixer}.x_proj"]
    assert isinstance(in_proj, ColumnSplit) and in_proj.parts == (64, 64)  # [x | z]: each rank its channels of both
    # Every channel's step size, B and C: each rank's channels give a share, summed over tp forward and backward.
    assert isinstance(x_proj, RowSplit) and x_proj.summed_gradient and x_proj.output_layouts == (Replicate(),)
    # Per channel: dt_proj's rows (read as a weight, never called), A_log's rows, D, the conv filters.
    assert {"A_log", "D", "dt_proj.weight", "dt_proj.bias", "conv1d.weight"} <= set(found.tp_plan[mixer].names)
    # Jamba's norms on the step sizes, B and C: whole, each rank's gradient a share.
    assert all(isinstance(found.tp_plan[f"{mixer}.{n}"], SummedGradients)
               for n in ("dt_layernorm", "b_layernorm", "c_layernorm"))
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95
