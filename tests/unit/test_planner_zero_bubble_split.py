"""Zero bubble's split backward as measured (issue 31): torch runs a block's backward as the input's gradient
(with ``retain_graph``, after walking the autograd graph in Python to group the weights' nodes) and later the
weights', which costs more than one whole backward -- on one CPU core two 64-wide blocks took 4.4 ms whole and
6.1 split -- where the schedule had been modelled as interleaved 1F1B with a smaller bubble. The calibration
times the split against the whole at two micro-batch sizes (``calibrate.zero_bubble_split_seconds_per_token``)
and every block of a zero-bubble layout but the first stage's pays it."""

import pytest
import torch

from helpers.calibration_fields import meta_block_and_call
from lightning_3d.models import GPTConfig
from lightning_3d.models.gpt import Block
from lightning_3d.planner import (PRECISIONS, Calibration, Cluster, Layout, LinkSpeed, ModelSpec, PlannerError,
                                  estimate_step_time)
from lightning_3d.planner.cluster import GIB
from lightning_3d.strategies import calibrate

FAST = LinkSpeed(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
MODEL = ModelSpec(num_layers=4, hidden_size=64, num_heads=8, vocab_size=256, seq_length=64, name="gpt-4x64")
CLUSTER = Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=8 * GIB)
BLOCK_S_PER_TOKEN = 4e-6


def calibration(split=None) -> Calibration:
    return Calibration(block_seconds_per_token={2: BLOCK_S_PER_TOKEN}, head_seconds_per_token=1e-7, tp=FAST,
                       pp=FAST, dp=FAST, zero_bubble_split_seconds_per_token=split or {})


def compute(layout: Layout, split=None) -> float:
    return estimate_step_time(MODEL, layout, CLUSTER, PRECISIONS["32-true"], calibration=calibration(split)).compute


SPLIT = {1: 3e-6, 4: 1e-6}
"""Seconds per token the split adds at 1 and 4 sequences: much of it is per call, so less per token at 4."""


def test_every_block_but_the_first_stages_pays_the_split_share():
    # pp2 v2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (the head: the slowest rank), one block each.
    layout = Layout(dp=4, pp=2, virtual_stages=2, num_microbatches=4, micro_batch_size=2, schedule="zero_bubble")
    tokens = 2 * MODEL.seq_length
    per_call = (1 * 3e-6 + (4 * 1e-6 - 1 * 3e-6) * (2 - 1) / (4 - 1)) / 2 * tokens  # the call's time, linear in b
    assert compute(layout, SPLIT) - compute(layout) == pytest.approx(4 * 2 * per_call)
    one_stage_each = Layout(dp=4, pp=2, virtual_stages=1, num_microbatches=4, micro_batch_size=2,
                            schedule="zero_bubble")  # rank 1: stage 1, two blocks, split
    assert compute(one_stage_each, SPLIT) - compute(one_stage_each) == pytest.approx(4 * 2 * per_call)


@pytest.mark.parametrize("layout", [
    Layout(dp=4, pp=2, virtual_stages=2, num_microbatches=4, micro_batch_size=2, schedule="interleaved_1f1b"),
    Layout(dp=4, pp=2, num_microbatches=4, micro_batch_size=2),
    Layout(dp=8, micro_batch_size=8, num_microbatches=1)], ids=["interleaved", "1f1b", "no pipeline"])
def test_other_schedules_keep_their_whole_backward(layout):
    assert compute(layout, SPLIT) == compute(layout)


def test_the_measurement_travels_with_the_calibration_and_is_checked():
    import json

    measured = calibration(SPLIT)
    assert Calibration.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    older = measured.to_dict()
    del older["zero_bubble_split_seconds_per_token"]  # a calibration written before it was measured
    assert Calibration.from_dict(older).zero_bubble_split_seconds(2) == 0.0
    for bad in ({0: 1e-6}, {2: -1e-9}, {2: float("nan")}):
        with pytest.raises(PlannerError, match="zero_bubble_split_seconds_per_token"):
            calibration(bad)


def test_the_timed_split_computes_the_gradients_the_whole_backward_does(monkeypatch):
    """What is timed is the same work: both runs leave the same weight gradients."""
    torch.manual_seed(0)
    block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    call = ((torch.randn(4, 16, 32),), {})
    grads = []
    for split in (False, True):
        block.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same random input for both
        run, tokens = calibrate._call_run(block, call, 4, 2, torch.device("cpu"), split_backward=split)
        run()
        grads.append([p.grad.clone() for p in block.parameters()])
    assert tokens == 2 * 16
    for whole, split in zip(*grads):
        torch.testing.assert_close(split, whole)


def test_the_calibration_times_the_split_against_the_whole_backward(monkeypatch):
    block, call = meta_block_and_call()
    timed = []

    def median_extra_seconds(base, extra, device, min_seconds=0.0):  # runs each once; a fixed difference
        for run in (base, extra):
            run()
            timed.append(run)
        return 2e-3

    monkeypatch.setattr(calibrate, "median_extra_seconds", median_extra_seconds)
    split = calibrate.zero_bubble_split_seconds_per_token(block, call, 4, [1, 4], torch.device("cpu"))
    assert split == pytest.approx({1: 2e-3 / 16, 4: 2e-3 / (4 * 16)})
    assert len(timed) == 4
