"""What DTensor parameters and FSDP2's wrapping cost, in the step-time model (issue 31). DTensor's dispatch costs
the same per tensor whatever its size, several times the arithmetic of a small model's optimizer step; FSDP2's
hooks cost per block call whatever the tokens. The calibration measures both (calibrate_optimizer.
dtensor_optimizer_seconds_per_block, calibrate.fsdp_block_call_seconds; each a difference of two runs, timed in
pairs: calibrate_timing.median_extra_seconds) and the step time charges them where a layout has them: DTensor
parameters under tensor parallelism or FSDP2; FSDP2 where dp > 1 under a pipeline, tensor parallelism or ZeRO.
Not under DistributedDataParallel, not on a lone pipeline stage."""

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers.calibration_fields import meta_block_and_call
from lightning_3d.models import GPTConfig
from lightning_3d.models.gpt import Block
from lightning_3d.planner import (PRECISIONS, Calibration, Cluster, Layout, LinkSpeed, ModelSpec, estimate_step_time,
                                  latency_steps, wire_bytes)
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.memory import rank_blocks
from lightning_3d.strategies import calibrate, calibrate_optimizer, calibrate_timing

FAST = LinkSpeed(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
MODEL = ModelSpec(num_layers=8, hidden_size=256, num_heads=8, vocab_size=4096, seq_length=256, name="gpt-8x256")
CLUSTER = Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=8 * GIB)
PER_BLOCK = 5e-3


def step_time_calibration(**measured) -> Calibration:
    return Calibration(block_seconds_per_token={1: 4e-6}, head_seconds_per_token=1e-7, tp=FAST, pp=FAST, dp=FAST,
                       optimizer_seconds_per_parameter=1e-9, **measured)


def step_time(layout: Layout, **measured):
    calibration = step_time_calibration(**measured)
    return estimate_step_time(MODEL, layout, CLUSTER, PRECISIONS["32-true"], calibration=calibration)


LAYOUTS = [  # (layout, DTensor parameters, FSDP2 per block)
    (Layout(tp=2, dp=4), True, True),                        # FSDP2's replicate on the (dp, tp) mesh
    (Layout(tp=8), True, False),
    (Layout(dp=4, pp=2, num_microbatches=4), True, True),    # FSDP2's replicate on each stage
    (Layout(dp=8, zero_stage=2), True, True),                # FSDP2's fully_shard
    (Layout(dp=8), False, False),                            # DistributedDataParallel: plain tensors
    (Layout(pp=8, num_microbatches=8), False, False),        # a stage alone: plain tensors
]


def units(layout: Layout) -> int:
    """FSDP units of the busiest stage: its blocks and the rest of the stage."""
    return max(len(rank_blocks(MODEL, layout, rank)) for rank in range(layout.pp)) + 1


@pytest.mark.parametrize("layout, dtensors, fsdp", LAYOUTS)
def test_dtensor_dispatch_is_charged_per_fsdp_unit_where_the_parameters_are_dtensors(layout, dtensors, fsdp):
    extra = (step_time(layout, optimizer_dtensor_seconds_per_block=PER_BLOCK).optimizer
             - step_time(layout).optimizer)
    assert extra == pytest.approx(units(layout) * PER_BLOCK if dtensors else 0.0)


@pytest.mark.parametrize("layout, share", [(Layout(tp=8), 1 / 8), (Layout(dp=8, zero_stage=2), 1 / 8),
                                           (Layout(tp=2, dp=4), 1 / 2), (Layout(tp=2, dp=4, zero_stage=2), 1 / 8),
                                           (Layout(dp=4, pp=2, num_microbatches=4), 1.0)])
def test_a_rank_holding_a_share_of_its_blocks_numbers_pays_between_the_replicated_and_the_sharded_figure(
        layout, share):
    """DTensor's step costs per tensor and, less, per number: timed replicated (every number on every rank)
    and as FSDP2's shards over the world (1/8 here), a rank with 1/tp of the numbers, / the ZeRO group, pays
    along the line between the two."""
    sharded = PER_BLOCK / 2
    expected = sharded + (PER_BLOCK - sharded) * (share - 1 / 8) / (1 - 1 / 8)
    extra = (step_time(layout, optimizer_dtensor_seconds_per_block=PER_BLOCK,
                       optimizer_dtensor_seconds_per_sharded_block=sharded).optimizer - step_time(layout).optimizer)
    assert extra == pytest.approx(units(layout) * expected)


def test_the_sharded_figure_travels_with_the_calibration_and_is_checked():
    from helpers.calibration_fields import check_optional_field

    check_optional_field(lambda value=None: step_time_calibration(optimizer_dtensor_seconds_per_sharded_block=value),
                         "optimizer_dtensor_seconds_per_sharded_block", 2e-3, FAST)


@pytest.mark.parametrize("layout, dtensors, fsdp", LAYOUTS)
def test_fsdp_hooks_are_charged_per_block_call_where_fsdp2_wraps_the_blocks(layout, dtensors, fsdp):
    with_hooks, without = step_time(layout, fsdp_block_call_s=PER_BLOCK), step_time(layout)
    calls = layout.num_microbatches * units(layout)
    assert with_hooks.compute - without.compute == pytest.approx(calls * PER_BLOCK if fsdp else 0.0)


def test_the_calibration_measures_what_dtensor_parameters_add_to_an_adamw_step(monkeypatch):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    timed = []

    def median_extra_seconds(base, extra, device, min_seconds=0.0):  # runs each step once; a fixed time
        for run in (base, extra):
            run()
            timed.append({isinstance(p, DTensor) for p in run.__self__.param_groups[0]["params"]})
        return 3e-3

    monkeypatch.setattr(calibrate_optimizer, "median_extra_seconds", median_extra_seconds)
    extra = calibrate_optimizer.dtensor_optimizer_seconds_per_block(block, torch.device("cpu"))
    assert timed == [{False}, {True}]  # the block's parameters as they are, then as DTensors
    assert extra == pytest.approx(3e-3)


def test_the_sharded_calibration_times_fsdp2s_local_shards_against_plain_tensors_of_their_size(monkeypatch):
    world = 4
    mesh = type("Mesh", (), {"size": lambda self: world})()
    monkeypatch.setattr(calibrate_optimizer, "world_mesh", lambda device: mesh)
    made = []

    def from_local(local, mesh, placements, run_check):  # records what would become a DTensor
        made.append((local.shape, placements))
        return local

    monkeypatch.setattr(DTensor, "from_local", staticmethod(from_local))
    monkeypatch.setattr(calibrate_optimizer, "median_extra_seconds",
                        lambda base, extra, device, min_seconds=0.0: 2e-3)
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    assert calibrate_optimizer.dtensor_optimizer_seconds_per_block(block, torch.device("cpu"), sharded=True) == 2e-3
    # Each tensor split along its first dimension over the 4 ranks, rounded up as FSDP2 pads it: (128, 32) ->
    # (32, 32), (32, 128) -> (8, 128).
    expected = {torch.Size([-(-p.shape[0] // world), *p.shape[1:]]) for p in block.parameters()}
    assert {local for local, _ in made} == expected
    assert all(str(placements[0]) == "S(0)" for _, placements in made)


def test_the_calibration_measures_what_fsdp2_adds_to_a_block_call(monkeypatch):
    block, call = meta_block_and_call()
    timed = []
    original = calibrate._call_run

    def call_run(module, *args):
        timed.append((type(module).__name__, any(isinstance(p, DTensor) for p in module.parameters())))
        return original(module, *args)

    def median_extra_seconds(base, extra, device, min_seconds=0.0):  # runs each once; a fixed difference
        base(), extra()
        return 8e-3

    monkeypatch.setattr(calibrate, "_call_run", call_run)
    monkeypatch.setattr(calibrate, "median_extra_seconds", median_extra_seconds)
    extra = calibrate.fsdp_block_call_seconds(block, call, 4, 2, torch.device("cpu"))
    assert timed[0] == ("Block", False) and timed[1][0] != "Block" and timed[1][1], timed  # alone, then FSDP2's
    assert extra == pytest.approx(8e-3)


def test_a_difference_is_timed_in_pairs_so_that_a_change_of_the_hosts_load_cancels():
    """The host's load drops after the first calls (as when other ranks finish their part of a calibration):
    two medians taken one after the other would put all of ``base``'s repetitions under the load and all of
    ``extra``'s after it, and find ``extra`` no slower (0); timed in pairs, each pair under one load, the
    difference is what ``extra`` adds."""
    calls = []

    def load() -> float:  # the first 8 calls run on a loaded host
        calls.append(None)
        return 0.05 if len(calls) <= 8 else 0.0

    def base() -> None:
        time.sleep(0.005 + load())

    def extra() -> None:
        time.sleep(0.015 + load())

    assert calibrate_timing.median_extra_seconds(base, extra, torch.device("cpu"), min_seconds=0.0) == pytest.approx(
        0.010, abs=0.004)


def test_a_head_timed_split_over_tp_replaces_the_even_split_of_the_whole_heads_time():
    layout = Layout(tp=2, dp=4)
    tokens = layout.micro_batch_size * MODEL.seq_length
    even, timed = step_time(layout), step_time(layout, tp_head_seconds_per_token={2: {1: 3e-7}})
    assert timed.compute == pytest.approx(even.compute)  # the even split (1e-7 per token / 2) stays compute
    # What the split adds is tensor-parallel work, in place of the head region's modelled all-reduce.
    message = tokens * MODEL.hidden_size * PRECISIONS["32-true"].activation_bytes
    head_region = FAST.seconds(wire_bytes("all_reduce", message, 2), latency_steps("all_reduce", 2))
    added = (3e-7 - 1e-7 / 2) * tokens
    assert timed.tp_communication - even.tp_communication == pytest.approx(added - head_region)
    other = Layout(tp=4, dp=2)  # a tp size not timed: modelled as before
    assert step_time(other, tp_head_seconds_per_token={2: {1: 3e-7}}) == step_time(other)


def test_the_calibration_times_the_head_split_over_the_vocabulary_with_the_vocab_parallel_loss(monkeypatch):
    from lightning_3d.parallel import loss

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest
    entered = []
    original = loss.vocab_parallel_ops

    def vocab_parallel_ops():
        entered.append(True)
        return original()

    monkeypatch.setattr(loss, "vocab_parallel_ops", vocab_parallel_ops)
    times = calibrate.tp_head_seconds_per_token(32, 256, 16, [1, 4], [1], torch.device("cpu"), repeat_s=0.01)
    assert list(times) == [1] and list(times[1]) == [1, 4] and all(t > 0 for t in times[1].values()) and entered


def test_the_split_heads_time_is_taken_at_the_layouts_micro_batch_size_not_scaled_from_another():
    # Mostly a cost per call: timed at 1 sequence it is 5x dearer per token than at 8. Charging a layout of
    # micro-batches of 8 the 1-sequence time per token had predicted tp8 layouts at 1.4-2.6x their measured steps.
    timed = {2: {1: 1e-3, 8: 2e-4}}
    calibration = Calibration.from_dict(json.loads(json.dumps({
        **step_time_calibration().to_dict(), "tp_head_seconds_per_token": timed})))
    assert calibration.tp_head_seconds_per_token == timed  # through JSON (string keys) and back
    assert calibration.tp_head_seconds(8, 2) == 2e-4 and calibration.tp_head_seconds(1, 2) == 1e-3
    assert calibration.tp_head_seconds(4, 2) == pytest.approx((1e-3 + (8 * 2e-4 - 1e-3) * 3 / 7) / 4)
    assert calibration.tp_head_seconds(4, 4) is None
    big, small = Layout(tp=2, dp=4, micro_batch_size=8), Layout(tp=2, dp=4, micro_batch_size=1)
    per_token = [(step_time(layout, tp_head_seconds_per_token=timed).tp_communication
                  - step_time(layout).tp_communication) / (layout.micro_batch_size * MODEL.seq_length)
                 for layout in (big, small)]
    assert per_token[0] < per_token[1] / 4
