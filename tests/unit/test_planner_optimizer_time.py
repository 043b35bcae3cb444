"""The optimizer step's time (issue 31): a block's parameters at the seconds per parameter timed on a block, the
ones outside the blocks (embeddings, final norm, head) at the figure timed on a tensor of the embedding's shape.
A block's many small tensors cost per tensor as much as per number: charged at the block's figure, the vocab
GPT of the sweep (8192 x 64 embedding and head, 84% of its parameters) was predicted a 45 ms AdamW step where
the step took 18 ms on 8 gloo ranks sharing 2 cores; split, 23 ms."""

import pytest
import torch

from helpers.calibration_fields import check_optional_field
from lightning_3d.planner import PRECISIONS, Calibration, Cluster, Layout, LinkSpeed, ModelSpec
from lightning_3d.planner import estimate_step_time
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.memory import rank_blocks, rank_parameters

FP32 = PRECISIONS["32-true"]
LINK = LinkSpeed(latency_s=1e-3, bandwidth_bytes_per_s=1e9)
MODEL = ModelSpec(num_layers=4, hidden_size=64, num_heads=8, vocab_size=8192, seq_length=64, name="gpt-4x64-v8k")
CLUSTER = Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=8 * GIB)
BLOCK, EMBEDDING = 3.6e-8, 1.5e-8
"""Seconds per parameter, as 8 gloo ranks on 2 cores timed them for that model's block and embedding."""


def calibration(embedding=EMBEDDING) -> Calibration:
    return Calibration(block_seconds_per_token={8: 5e-5}, head_seconds_per_token=3e-4, tp=LINK, pp=LINK, dp=LINK,
                       optimizer_seconds_per_parameter=BLOCK, optimizer_seconds_per_embedding_parameter=embedding)


def optimizer_seconds(layout: Layout, measured: Calibration) -> float:
    return estimate_step_time(MODEL, layout, CLUSTER, FP32, calibration=measured).optimizer


@pytest.mark.parametrize("layout", [Layout(dp=8, micro_batch_size=8, num_microbatches=1),
                                    Layout(dp=4, pp=2, micro_batch_size=2, num_microbatches=4)],
                         ids=["whole-model", "pipeline"])
def test_the_blocks_and_the_rest_each_pay_their_own_figure(layout):
    # the busiest pipeline rank: the one holding the most parameters
    rank = max(range(layout.pp), key=lambda r: rank_parameters(MODEL, layout, r))
    in_blocks = len(rank_blocks(MODEL, layout, rank)) * MODEL.block_params().per_rank(layout.tp)
    outside = rank_parameters(MODEL, layout, rank) - in_blocks
    assert outside > in_blocks  # the vocabulary's tensors hold most of the parameters
    assert optimizer_seconds(layout, calibration()) == pytest.approx(in_blocks * BLOCK + outside * EMBEDDING)


def test_without_the_embeddings_figure_every_parameter_pays_the_blocks():
    """A calibration written before the figure was timed keeps its earlier prediction."""
    layout = Layout(dp=8, micro_batch_size=8, num_microbatches=1)
    assert optimizer_seconds(layout, calibration(None)) == pytest.approx(rank_parameters(MODEL, layout, 0) * BLOCK)


def test_the_figure_travels_with_the_calibration_and_is_checked():
    check_optional_field(calibration, "optimizer_seconds_per_embedding_parameter", EMBEDDING, LINK)


def test_the_embeddings_timing_holds_its_shape_up_to_its_limit(monkeypatch):
    """A large model's embedding (Llama 3 8B's: 2 GiB of float32) is timed as a flat tensor of the limit's size:
    per number, a tensor that large costs what any larger one does."""
    from lightning_3d.strategies import calibrate_optimizer

    timed = []
    monkeypatch.setattr(calibrate_optimizer, "median_seconds", lambda run, *args, **kwargs: timed.append(run) or 1.0)
    small = calibrate_optimizer.embedding_optimizer_seconds_per_parameter(8192, 64, torch.device("cpu"))
    large = calibrate_optimizer.embedding_optimizer_seconds_per_parameter(128_256, 4096, torch.device("cpu"))
    shapes = [[p.shape for group in step.__self__.param_groups for p in group["params"]] for step in timed]
    assert shapes == [[torch.Size([8192, 64])], [torch.Size([calibrate_optimizer.EMBEDDING_PROBE_NUMBERS])]]
    assert (small, large) == (1.0 / (8192 * 64), 1.0 / calibrate_optimizer.EMBEDDING_PROBE_NUMBERS)
