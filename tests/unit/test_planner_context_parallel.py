"""The planner knows context parallelism (issue 56): the blocks hold s / cp tokens of each sequence and their
attention keeps only its q, k, v and output; the embeddings, head and loss hold the whole sequence on every cp
rank; ZeRO shards over dp x cp; the keys' and values' all-gathers are a step-time term of their own; the search
offers cp on long sequences, and the layout maps back to the strategy's setting."""

from dataclasses import replace

import pytest

from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner import plan
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, block_activation_bytes, chunk_activation_bytes, estimate_memory
from lightning_3d.planner.model import ModelSpec
from lightning_3d.planner.search import CP_MIN_TOKENS, evaluate

# Llama 3 8B's shape (GQA 32 / 8) on long sequences
MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, vocab_size=128256, seq_length=65536,
                  gated_mlp=True, ffn_hidden_size=14336, bias=False, norm="rmsnorm", learned_positions=False)
CLUSTER = Cluster.preset("h100", nodes=1)
BF16 = PRECISIONS["bf16-mixed"]


def layout(**kwargs) -> Layout:
    return Layout(**{**dict(micro_batch_size=1, num_microbatches=1), **kwargs})


def test_a_cp_layout_counts_its_ranks_shards_zero_over_dp_x_cp_and_maps_to_the_strategy():
    cp = layout(dp=2, cp=4, zero_stage=3)
    assert (cp.world_size, cp.dp_cp, cp.shard, cp.replicas) == (8, 8, 8, 1)
    assert cp.describe().startswith("dp2 cp4 tp1 pp1 ")
    assert cp.to_parallel_config() == ParallelConfig(data_parallel_size=2, context_parallel_size=4, zero_stage=3,
                                                     tensor_parallel_size=1, pipeline_parallel_size=1)
    whole, split = estimate_memory(MODEL, layout(dp=8, zero_stage=3), BF16, 0), estimate_memory(MODEL, cp, BF16, 0)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert getattr(split, part) == pytest.approx(getattr(whole, part)), part  # 8 shards either way


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_blocks_activations_fall_as_one_over_cp_less_its_attention_statistics(cp):
    one, split = layout(), layout(cp=cp)
    tokens, heads = MODEL.seq_length, MODEL.num_heads
    log_sum_exp = tokens * heads * 4  # fp32 per head and token, kept by the fused kernel; recomputed under cp
    assert block_activation_bytes(MODEL, split, BF16) == pytest.approx(
        (block_activation_bytes(MODEL, one, BF16) - log_sum_exp) / cp)
    # outside the blocks (the head and the loss on the last stage) every cp rank holds the whole sequence
    outside = chunk_activation_bytes(MODEL, one, BF16, 0)[0] - MODEL.num_layers * block_activation_bytes(MODEL, one, BF16)
    outside_cp = (chunk_activation_bytes(MODEL, split, BF16, 0)[0]
                  - MODEL.num_layers * block_activation_bytes(MODEL, split, BF16))
    assert outside_cp == pytest.approx(outside)


def test_cp_halves_the_blocks_compute_and_adds_its_all_gathers():
    one = evaluate(MODEL, layout(dp=8, zero_stage=3, recompute="full"), CLUSTER, BF16)
    two = evaluate(MODEL, layout(dp=4, cp=2, zero_stage=3, recompute="full"), CLUSTER, BF16)
    assert one.time.cp_communication == 0 < two.time.cp_communication
    # per sequence the same work, over twice the ranks: half the batch's compute per rank, the head's aside
    assert two.time.compute == pytest.approx(one.time.compute / 2, rel=0.05)
    assert two.memory.activations < one.memory.activations
    # keys and values (8 kv heads of 128 = 1024 wide of 4096) gathered 2 x 2 times and reduce-scattered twice
    # per block are a small part of the step on NVLink
    assert two.time.cp_communication < 0.05 * two.time.total


def test_the_search_splits_long_sequences_only():
    found = plan(MODEL, CLUSTER, global_batch_size=8, fixed={"tp": 1, "pp": 1})
    assert {c.layout.cp for c in found.candidates} >= {2, 4, 8}
    assert found.best.layout.cp > 1  # 64k tokens of one sequence do not fit one H100 at tp1 otherwise
    assert f"context_parallel_size: {found.best.layout.cp}" in found.to_yaml()
    assert " cp " in found.table().splitlines()[1] + " "  # the table's column of cp communication
    short = replace(MODEL, seq_length=2 * CP_MIN_TOKENS - 2)
    assert {c.layout.cp for c in plan(short, CLUSTER, global_batch_size=8, fixed={"pp": 1}).candidates} == {1}


def test_a_fixed_cp_is_held_and_dropout_rules_cp_out():
    held = plan(MODEL, CLUSTER, global_batch_size=8, fixed={"cp": 4, "pp": 1})
    assert {c.layout.cp for c in held.candidates} == {4}
    sixteen_k = replace(MODEL, seq_length=16384)
    assert {c.layout.cp for c in plan(sixteen_k, CLUSTER, global_batch_size=8).candidates} > {1}
    with_dropout = replace(sixteen_k, dropout=0.1)  # lightning-3d refuses attention dropout under cp
    assert {c.layout.cp for c in plan(with_dropout, CLUSTER, global_batch_size=8).candidates} == {1}
