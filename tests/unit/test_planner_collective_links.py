"""All-gather and reduce-scatter timed apart from the all-reduce (issue 31): the calibration keeps them, and the
step-time model charges ZeRO's and sequence parallelism's collectives at their own speeds; without a core
to spare, ZeRO-3's gathers are not hidden behind compute."""

import json

import pytest

from lightning_3d.planner import (
    PRECISIONS,
    Calibration,
    Cluster,
    Layout,
    LinkSpeed,
    ModelSpec,
    PlannerError,
    estimate_step_time,
    latency_steps,
    wire_bytes,
)
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.memory import rank_blocks, rank_parameters

FP32 = PRECISIONS["32-true"]
ALL_REDUCE_FIT = LinkSpeed(latency_s=1e-3, bandwidth_bytes_per_s=1e9)
SLOW_SCATTER = LinkSpeed(latency_s=3e-3, bandwidth_bytes_per_s=0.4e9)
"""A reduce-scatter as gloo on ranks sharing cores gives it: slower than the all-reduce's fit predicts."""
MODEL = ModelSpec(num_layers=4, hidden_size=64, num_heads=8, vocab_size=8192, seq_length=64, name="gpt-4x64")
CLUSTER = Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=8 * GIB)


def calibration(host_cores_per_rank=0.25, **collective_links) -> Calibration:
    return Calibration(block_seconds_per_token={8: 5e-5}, head_seconds_per_token=3e-4, tp=ALL_REDUCE_FIT,
                       pp=ALL_REDUCE_FIT, dp=ALL_REDUCE_FIT, host_cores_per_rank=host_cores_per_rank,
                       collective_links=collective_links)


def step(layout: Layout, measured: Calibration):
    return estimate_step_time(MODEL, layout, CLUSTER, FP32, calibration=measured)


def test_a_collective_timed_apart_is_kept_and_the_others_take_their_dimensions_link():
    measured = calibration(**{"dp.reduce_scatter": SLOW_SCATTER, "tp.all_gather": (2e-4, 5e9)})
    assert measured.link("dp", "reduce_scatter") == SLOW_SCATTER
    assert measured.link("tp", "all_gather") == LinkSpeed(latency_s=2e-4, bandwidth_bytes_per_s=5e9)
    assert measured.link("dp", "all_gather") == ALL_REDUCE_FIT  # not timed apart
    assert measured.link("dp") == measured.link("dp", "all_reduce") == ALL_REDUCE_FIT
    assert Calibration.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    made = Calibration.from_measurements({8: 5e-5}, 3e-4, {"tp": ALL_REDUCE_FIT, "pp": ALL_REDUCE_FIT,
                                                          "dp": ALL_REDUCE_FIT, "dp.reduce_scatter": SLOW_SCATTER})
    assert made.link("dp", "reduce_scatter") == SLOW_SCATTER
    with pytest.raises(PlannerError, match="dp.broadcast"):
        calibration(**{"dp.broadcast": SLOW_SCATTER})


def test_zero_pays_its_reduce_scatter_at_the_speed_it_was_timed_at():
    layout = Layout(dp=8, micro_batch_size=8, num_microbatches=1, zero_stage=2)
    units = len(rank_blocks(MODEL, layout, 0)) + 1  # FSDP2 units: each block, and the rest
    grads = rank_parameters(MODEL, layout, 0) * FP32.grad_bytes
    wire, hops = wire_bytes("reduce_scatter", grads / units, 8), latency_steps("reduce_scatter", 8)
    fit = step(layout, calibration()).dp_communication
    timed = step(layout, calibration(**{"dp.reduce_scatter": SLOW_SCATTER})).dp_communication
    expected = units * (SLOW_SCATTER.seconds(wire, hops) - ALL_REDUCE_FIT.seconds(wire, hops))
    assert timed - fit == pytest.approx(expected, rel=1e-9)
    assert expected > 0.05  # the difference matters: 50 ms on a step of a few hundred


def test_zero3_gathers_are_exposed_where_no_core_is_free_to_run_them_beside_compute():
    layout = Layout(dp=8, micro_batch_size=8, num_microbatches=1, zero_stage=3)
    units = len(rank_blocks(MODEL, layout, 0)) + 1
    weights = rank_parameters(MODEL, layout, 0) * FP32.param_bytes
    gather = ALL_REDUCE_FIT.seconds(wire_bytes("all_gather", weights / units, 8), latency_steps("all_gather", 8))
    shared_cores = calibration(host_cores_per_rank=0.25)
    zero2 = step(Layout(dp=8, micro_batch_size=8, num_microbatches=1, zero_stage=2), shared_cores)
    zero3 = step(layout, shared_cores)
    assert zero3.dp_communication - zero2.dp_communication == pytest.approx(2 * units * gather, rel=1e-9)
    # With cores to spare the gathers are prefetched behind the blocks' compute, here longer than them.
    spare_cores = calibration(host_cores_per_rank=4.0)
    assert 2 * units * gather < step(layout, spare_cores).compute
    assert step(layout, spare_cores).dp_communication == pytest.approx(
        step(Layout(dp=8, micro_batch_size=8, num_microbatches=1, zero_stage=2), spare_cores).dp_communication)


def test_sequence_parallel_regions_pay_one_reduce_scatter_and_one_all_gather():
    layout = Layout(tp=2, dp=4, micro_batch_size=8, num_microbatches=1, sequence_parallel=True)
    message = 8 * MODEL.seq_length * MODEL.hidden_size * FP32.activation_bytes
    wire, hops = wire_bytes("reduce_scatter", message, 2), latency_steps("reduce_scatter", 2)
    regions = 4 * MODEL.num_layers + 2  # per block 2 forward, 2 backward; the embedding's and the head's
    fit = step(layout, calibration()).tp_communication
    timed = step(layout, calibration(**{"tp.reduce_scatter": SLOW_SCATTER})).tp_communication
    assert timed - fit == pytest.approx(regions * (SLOW_SCATTER.seconds(wire, hops)
                                                   - ALL_REDUCE_FIT.seconds(wire, hops)), rel=1e-9)
