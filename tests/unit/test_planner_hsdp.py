"""The planner knows HSDP (issue 32): ZeRO's states divide by the shard group, not all of dp; the reduce-scatter
and all-gather run within a node and only each rank's shard crosses nodes, in an all-reduce over the replicas;
the search offers HSDP where dp crosses nodes, and a layout maps back to the strategy's setting."""

import pytest

from lightning_3d.planner import plan
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, estimate_memory
from lightning_3d.planner.model import ModelSpec
from lightning_3d.planner.search import evaluate

MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000, seq_length=4096,
                  gated_mlp=True, ffn_hidden_size=11008, bias=False, norm="rmsnorm", learned_positions=False)
CLUSTER = Cluster.preset("h100", nodes=4)  # 32 GPUs, 8 per node, slower links across nodes
BF16 = PRECISIONS["bf16-mixed"]


def test_zero_states_divide_by_the_shard_group():
    fsdp = Layout(dp=32, zero_stage=3, micro_batch_size=1, num_microbatches=1)
    hsdp = Layout(dp=32, dp_shard=8, zero_stage=3, micro_batch_size=1, num_microbatches=1)
    full, half = estimate_memory(MODEL, fsdp, BF16, 0), estimate_memory(MODEL, hsdp, BF16, 0)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert getattr(half, part) == pytest.approx(4 * getattr(full, part)), part  # 8 shards, not 32
    assert hsdp.replicas == 4 and hsdp.describe().startswith("dp32(4x8) ")
    assert hsdp.to_parallel_config().data_parallel_shard_size == 8
    assert fsdp.to_parallel_config().data_parallel_shard_size == "auto"


def test_hsdp_moves_less_across_nodes_than_zero_over_all_of_dp():
    fsdp = evaluate(MODEL, Layout(dp=32, zero_stage=3, micro_batch_size=1, num_microbatches=1), CLUSTER, BF16)
    hsdp = evaluate(MODEL, Layout(dp=32, dp_shard=8, zero_stage=3, micro_batch_size=1, num_microbatches=1),
                    CLUSTER, BF16)
    assert hsdp.time.dp_communication < fsdp.time.dp_communication  # within-node gathers, a shard across nodes
    assert hsdp.memory.total > fsdp.memory.total  # the price: 4 copies of the states


def test_the_search_offers_hsdp_where_dp_crosses_nodes_and_takes_a_fixed_shard_size():
    found = plan(MODEL, CLUSTER, global_batch_size=64, fixed={"tp": 1, "pp": 1, "zero_stage": 3, "recompute": "full"})
    shards = {c.layout.dp_shard for c in found.candidates}
    assert shards == {0, 8}, shards
    held = plan(MODEL, CLUSTER, global_batch_size=64, fixed={"tp": 2, "pp": 1, "zero_stage": 3, "dp_shard": 4,
                                                              "recompute": "full"})
    assert {c.layout.shard for c in held.candidates} == {4}
    assert "data_parallel_shard_size: 4" in held.to_yaml()  # the config it writes runs that HSDP
