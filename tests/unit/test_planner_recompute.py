"""What activation checkpointing costs (issue 31): the calibration measures what recomputing a block's forward
adds, as a share of the block's forward + backward, and the step time charges each recomputed block that
share instead of the third a forward's FLOPs would give."""

import pytest
import torch

from lightning_3d.models.gpt import Block, GPTConfig
from lightning_3d.planner import PRECISIONS, Calibration, Cluster, Layout, LinkSpeed, ModelSpec, estimate_step_time
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.memory import checkpointed_blocks
from lightning_3d.strategies import calibrate

FAST = LinkSpeed(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
MODEL = ModelSpec(num_layers=8, hidden_size=256, num_heads=8, vocab_size=4096, seq_length=256, name="gpt-8x256")
CLUSTER = Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=8 * GIB)
BLOCK_S_PER_TOKEN = 4e-6


def compute(layout: Layout, share: float | None) -> float:
    calibration = Calibration(block_seconds_per_token={1: BLOCK_S_PER_TOKEN}, head_seconds_per_token=1e-7,
                              tp=FAST, pp=FAST, dp=FAST, recompute_share=share)
    return estimate_step_time(MODEL, layout, CLUSTER, PRECISIONS["32-true"], calibration=calibration).compute


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("share", [None, 0.8])
def test_each_recomputed_block_is_charged_the_measured_share_of_its_forward_and_backward(mode, share):
    layout = Layout(dp=8, micro_batch_size=1, recompute=mode)
    block_s = BLOCK_S_PER_TOKEN * MODEL.seq_length
    recomputed = len(checkpointed_blocks(MODEL, layout))
    added = compute(layout, share) - compute(Layout(dp=8, micro_batch_size=1), share)
    assert added == pytest.approx(recomputed * block_s * (1 / 3 if share is None else share))


def test_the_calibration_times_the_block_checkpointed_against_the_block_alone(monkeypatch):
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    call = ((torch.empty(4, 16, 32, device="meta"),), {})
    timed = []
    original = calibrate._call_run

    def call_run(module, *args):  # which modules are timed, and whether torch's checkpoint hooks them
        timed.append(bool(module._forward_pre_hooks))
        return original(module, *args)

    def median_extra_seconds(base, extra, device, min_seconds=0.0):
        base(), extra()
        return 4e-3

    monkeypatch.setattr(calibrate, "_call_run", call_run)
    monkeypatch.setattr(calibrate, "median_extra_seconds", median_extra_seconds)
    per_token = 10e-3 / (2 * 16)  # the block's forward + backward measured at 2 sequences of 16: 10 ms
    assert calibrate.recompute_share(block, call, 4, 2, per_token, torch.device("cpu")) == pytest.approx(0.4)
    assert timed == [False, True]  # the block alone, then under activation checkpointing
