"""policy="auto" at tp on linear-attention layers that transformers runs through named kernels (issue 52):
Kimi Delta Attention (``chunk_kda``: Kimi Linear, Bailing hybrid) and the mLSTM backend (xLSTM), each traced
as one attention product per head (policies/scan_kernels.py)."""

import pytest
import torch
from torch import nn

from lightning_3d.policies import PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.block_inputs import block_inputs
from lightning_3d.policies.block_trace import trace_block
from lightning_3d.policies.feature_weights import split_dim
from lightning_3d.policies.head_weights import HeadWeights
from lightning_3d.policies.projections import ColumnSplit, RowSplit

transformers = pytest.importorskip("transformers")
configs = pytest.importorskip("helpers.census.configs")


def _tiny(model_type):
    """The census's tiny model (4 heads of 8 features, hidden size 32), on the meta device."""
    with torch.device("meta"):
        return nn.ModuleDict({"model": configs.build(model_type)})


def test_a_weight_with_leading_ones_splits_along_its_first_longer_dimension():
    assert split_dim(torch.empty(1, 1, 4, 1)) == 2  # Kimi's A_log, one value per head, shaped to broadcast
    assert split_dim(torch.empty(4)) == 0
    assert split_dim(torch.empty(8, 1, 3)) == 0  # a depthwise convolution's filters


def test_kimi_delta_attention_splits_its_heads_with_their_decays_and_feeds_its_low_rank_gates_whole():
    root = _tiny("kimi_linear")
    found = AutoPolicy().plan(root, PlanOptions(tp=2))
    attn = "model.model.layers.0.self_attn"
    for column in ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_b_proj", "g_b_proj"):
        assert isinstance(found.tp_plan[f"{attn}.{column}"], ColumnSplit), column
    assert isinstance(found.tp_plan[f"{attn}.o_proj"], RowSplit)
    # A_log (1, 1, heads, 1) per head and dt_bias per key feature split with the heads; the gate module is not
    # also held whole with summed gradients (as the feeders' other modules are).
    gate = found.tp_plan[f"{attn}.forget_gate"]
    assert isinstance(gate, HeadWeights) and set(gate.names) == {"A_log", "dt_bias"} and gate.inner is None
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9


def test_bailing_hybrid_linear_attention_splits_its_heads():
    root = _tiny("bailing_hybrid")
    found = AutoPolicy().plan(root, PlanOptions(tp=2))
    attn = "model.model.layers.0.self_attn"
    assert isinstance(found.tp_plan[f"{attn}.q_proj"], ColumnSplit)
    assert isinstance(found.tp_plan[f"{attn}.o_proj"], RowSplit)
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9


def test_the_mlstm_backend_is_one_attention_product_per_head():
    root = _tiny("xlstm")
    block = root["model"].backbone.blocks[0]
    args, kwargs = block_inputs(root["model"], block, 32)
    trace = trace_block(block, args, kwargs)
    assert trace.problem is None and len(trace.attention) == 1
    event = trace.attention[0]
    heads = len(event.q)
    assert heads == 4
    # Head h: its 4 query and key features, its 8 value features, its own input and forget gate.
    assert event.q[1]["mlstm_layer.q"] == frozenset(range(4, 8))
    assert event.q[1]["mlstm_layer.igate_preact"] == frozenset({1})
    assert event.q[1]["mlstm_layer.fgate_preact"] == frozenset({1})
    assert event.k[1]["mlstm_layer.k"] == frozenset(range(4, 8))
    assert event.v[1]["mlstm_layer.v"] == frozenset(range(8, 16))
