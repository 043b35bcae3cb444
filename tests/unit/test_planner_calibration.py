"""The planner with measured speeds (issue 31): the Calibration type, the step time it gives, and the layout
decisions it leads to on CPU ranks, with fixed calibration numbers."""

import json
from dataclasses import replace

import pytest

from lightning_3d.planner import (
    PRECISIONS,
    Calibration,
    Cluster,
    Layout,
    LinkSpeed,
    ModelSpec,
    NoLayoutFits,
    PlannerError,
    estimate_step_time,
    latency_steps,
    plan,
    wire_bytes,
)
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.memory import rank_parameters
from lightning_3d.planner.search import enumerate_layouts, evaluate

FP32 = PRECISIONS["32-true"]
FAST = LinkSpeed(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
SLOW = LinkSpeed(latency_s=1e-3, bandwidth_bytes_per_s=1e8)
GLOO = LinkSpeed(latency_s=2e-4, bandwidth_bytes_per_s=2e9)
"""About what gloo gives between processes of one host."""


def calibration(*, tp=FAST, pp=FAST, dp=FAST, block=None, head=1e-7, optimizer=None,
                tp_block_seconds_per_token=None, host_cores_per_rank=None) -> Calibration:
    return Calibration(block_seconds_per_token=block or {1: 4e-6, 4: 2e-6}, head_seconds_per_token=head,
                       tp=tp, pp=pp, dp=dp, optimizer_seconds_per_parameter=optimizer,
                       tp_block_seconds_per_token=tp_block_seconds_per_token or {},
                       host_cores_per_rank=host_cores_per_rank)


# A GPT of 8 blocks, 256 wide (about 7M parameters, 0.1 GiB of fp32 Adam states), on 8 CPU ranks.
MODEL = ModelSpec(num_layers=8, hidden_size=256, num_heads=8, vocab_size=4096, seq_length=256, name="gpt-8x256")


def cpu(memory_gib=8.0) -> Cluster:
    return Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=memory_gib * GIB)


# ------------------------------------------------------------------------------------------------- the type


def test_calibration_goes_through_a_plain_dict_and_json_unchanged():
    original = Calibration(block_seconds_per_token={4: 2e-6, 1: 4e-6}, head_seconds_per_token=1e-7, tp=FAST,
                           pp=SLOW, dp=LinkSpeed(latency_s=2e-5, bandwidth_bytes_per_s=3e9),
                           optimizer_seconds_per_parameter=1e-9, tp_block_seconds_per_token={2: {8: 1e-6, 1: 3e-6}},
                           host_cores_per_rank=0.25, pipeline_microbatch_s=2e-3)
    values = original.to_dict()
    assert json.loads(json.dumps(values)) != values  # JSON turns the micro-batch keys into strings ...
    assert Calibration.from_dict(json.loads(json.dumps(values))) == original  # ... which come back as ints
    assert list(original.block_seconds_per_token) == [1, 4] and list(original.tp_block_seconds_per_token[2]) == [1, 8]


def test_calibration_takes_the_strategys_measurements_in_any_link_form():
    class Measured:  # what strategies/calibrate.py hands over: two attributes
        latency_s, bandwidth_bytes_per_s = 1e-5, 2e9

    made = Calibration.from_measurements({1: 3e-6}, 1e-7, {"tp": Measured(), "pp": (2e-5, 1e9),
                                                            "dp": {"latency_s": 3e-5, "bandwidth_bytes_per_s": 5e8}})
    assert made.tp == LinkSpeed(latency_s=1e-5, bandwidth_bytes_per_s=2e9)
    assert made.pp.seconds(1e9) == pytest.approx(2e-5 + 1.0)
    with pytest.raises(PlannerError, match=r"missing \['dp'\]"):
        Calibration.from_measurements({1: 3e-6}, 1e-7, {"tp": FAST, "pp": FAST})


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_seconds_per_token={}), "is empty"),
    (dict(block_seconds_per_token={0: 1e-6}), "micro-batch sizes >= 1"),
    (dict(head_seconds_per_token=-1.0), "head_seconds_per_token"),
    (dict(tp_block_seconds_per_token={1: {1: 1e-6}}), "tp sizes >= 2"),
    (dict(tp_block_seconds_per_token={2: {}}), "tp sizes >= 2"),
    (dict(host_cores_per_rank=0.0), "host_cores_per_rank"),
])
def test_a_calibration_with_impossible_numbers_is_refused(kwargs, message):
    values = dict(block_seconds_per_token={1: 1e-6}, head_seconds_per_token=1e-7, tp=FAST, pp=FAST, dp=FAST)
    with pytest.raises(PlannerError, match=message):
        Calibration(**{**values, **kwargs})


def test_two_message_sizes_give_latency_and_bandwidth():
    link = LinkSpeed.fit(wire=(2**16, 2**22), seconds=(1e-4 + 2**16 / 1e9, 1e-4 + 2**22 / 1e9))
    assert link.latency_s == pytest.approx(1e-4) and link.bandwidth_bytes_per_s == pytest.approx(1e9)
    noisy = LinkSpeed.fit(wire=(2**16, 2**22), seconds=(3e-4, 2e-4))  # the larger message came back faster
    assert noisy.latency_s == 3e-4 and noisy.bandwidth_bytes_per_s == pytest.approx(2**22 / 2e-4)


def test_block_time_is_interpolated_between_measured_sizes_and_clamped_outside():
    # A call's time (sequences x per-token time) is a line between the sizes timed: a fixed cost per call and
    # one per token. At 4 sequences 2.67e-6 per token, where a line through the per-token times gives 3.33e-6.
    cal = calibration(block={2: 4e-6, 8: 2e-6})
    call_4 = 2 * 4e-6 + (8 * 2e-6 - 2 * 4e-6) * (4 - 2) / (8 - 2)
    assert [cal.block_seconds(b) for b in (1, 2, 4, 8, 16)] == pytest.approx([4e-6, 4e-6, call_4 / 4, 2e-6, 2e-6])


def test_a_smaller_micro_batch_timed_cheaper_per_token_than_a_larger_one_takes_the_larger_ones_time():
    # Issue 31's wide shape: on 8 ranks over 2 cores one calibration timed a block at 2 sequences 1.4x cheaper
    # per token than at 8 (alone it is 1.09x dearer), and auto chose a pipeline of micro-batches of 2 for it.
    noisy = calibration(block={1: 213e-6, 2: 195e-6, 4: 280e-6, 8: 268e-6})
    assert noisy.block_seconds_per_token == pytest.approx({1: 280e-6, 2: 280e-6, 4: 280e-6, 8: 268e-6})
    steady = calibration(block={2: 3.3e-4, 8: 2.5e-4})  # falling per-token times are kept as timed
    assert steady.block_seconds_per_token == {2: 3.3e-4, 8: 2.5e-4}
    split = Calibration.from_dict({**steady.to_dict(), "tp_block_seconds_per_token": {2: {1: 1e-4, 8: 2e-4}}})
    assert split.tp_block_seconds_per_token == {2: {1: 2e-4, 8: 2e-4}}


def test_a_timed_repetition_lasts_longer_where_ranks_share_cores():
    from lightning_3d.strategies.calibrate_timing import (
        MIN_REPEAT_SECONDS,
        SHARED_CORES_REPEAT_SECONDS,
        repeat_seconds,
    )

    assert repeat_seconds(None) == repeat_seconds(2.0) == repeat_seconds(1.0) == MIN_REPEAT_SECONDS  # GPUs; cores
    assert repeat_seconds(0.25) == SHARED_CORES_REPEAT_SECONDS > MIN_REPEAT_SECONDS  # 8 ranks on 2 cores


def test_the_head_is_timed_with_its_loss_and_the_optimizer_on_a_blocks_own_parameters():
    """One process: the head's time covers the cross-entropy (its backward reaches the weight through the softmax),
    and the optimizer's per-parameter time comes from an AdamW step over the block's own tensors."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig
    from lightning_3d.strategies import calibrate, calibrate_optimizer

    calls = []
    original = torch.nn.functional.cross_entropy
    torch.nn.functional.cross_entropy = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        head = calibrate.head_seconds_per_token(16, 64, 32, torch.device("cpu"), repeat_s=0.001)
    finally:
        torch.nn.functional.cross_entropy = original
    assert calls and 0 < head < 1
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    adam_steps = []
    original_step = torch.optim.AdamW.step
    torch.optim.AdamW.step = lambda self, *a, **k: adam_steps.append(len(self.param_groups[0]["params"])) \
        or original_step(self, *a, **k)
    try:
        per_parameter = calibrate_optimizer.optimizer_seconds_per_parameter(block, torch.device("cpu"), repeat_s=0.001)
    finally:
        torch.optim.AdamW.step = original_step
    assert adam_steps and set(adam_steps) == {len(list(block.parameters()))} and 0 < per_parameter < 1e-3


def test_the_pipeline_schedules_own_cost_is_paid_per_micro_batch_and_chunk_and_only_under_a_pipeline():
    # Measured at launch by a two-stage schedule on the pipeline pairs (calibrate_links.pipeline_microbatch_seconds).
    plain, probed = calibration(), calibration(block={1: 4e-6, 4: 2e-6})
    probed = Calibration.from_dict({**probed.to_dict(), "pipeline_microbatch_s": 1e-3})
    for layout, chunks in ((Layout(dp=2, pp=4, num_microbatches=8, micro_batch_size=1), 1),
                           (Layout(dp=2, pp=4, num_microbatches=8, micro_batch_size=1, virtual_stages=2,
                                   schedule="interleaved_1f1b"), 2)):
        before = estimate_step_time(MODEL, layout, cpu(), FP32, calibration=plain)
        after = estimate_step_time(MODEL, layout, cpu(), FP32, calibration=probed)
        assert after.pp_communication - before.pp_communication == pytest.approx(8 * chunks * 1e-3)
        assert after.pp_bubble > before.pp_bubble  # a longer micro-batch, a longer bubble
    single = Layout(dp=8, micro_batch_size=1, num_microbatches=1)
    assert (estimate_step_time(MODEL, single, cpu(), FP32, calibration=probed).total
            == estimate_step_time(MODEL, single, cpu(), FP32, calibration=plain).total)
    with pytest.raises(PlannerError, match="pipeline_microbatch_s"):
        Calibration.from_dict({**plain.to_dict(), "pipeline_microbatch_s": -1.0})


def test_wire_bytes_are_the_ring_algorithms():
    assert wire_bytes("all_reduce", 100, 4) == 150 and wire_bytes("all_gather", 100, 4) == 75
    assert wire_bytes("send", 100, 2) == 100 and wire_bytes("all_reduce", 100, 1) == 0


# --------------------------------------------------------------------------------------------- step time


def test_calibrated_step_time_is_the_measured_block_time_split_over_tp_plus_the_links_latency_and_bytes():
    tp_link = LinkSpeed(latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    cal = calibration(tp=tp_link, block={2: 3e-6}, head=6e-7)
    layout = Layout(tp=2, micro_batch_size=2, num_microbatches=3, recompute="full")
    time = estimate_step_time(MODEL, layout, cpu(), FP32, calibration=cal)
    tokens = 2 * MODEL.seq_length
    block = 3e-6 * tokens / 2
    per_microbatch = MODEL.num_layers * block * (1 + 1 / 3) + 6e-7 * tokens / 2  # recompute: one more forward
    assert time.compute == pytest.approx(3 * per_microbatch)
    # Without sequence parallelism: one all-reduce per region, 4 per block, 2 per recomputed block, and one
    # each for the embedding and the head, of a b s h fp32 activation.
    # An all-reduce over 2 ranks is two ring steps (a reduce-scatter and an all-gather), each paying the latency.
    calls = 6 * MODEL.num_layers + 2
    message = tokens * MODEL.hidden_size * 4
    per_call = 2 * tp_link.latency_s + wire_bytes("all_reduce", message, 2) / tp_link.bandwidth_bytes_per_s
    assert time.tp_communication == pytest.approx(3 * calls * per_call)
    # With it, each all-reduce is a reduce-scatter and an all-gather call: the same bytes and the same ring steps.
    sp = estimate_step_time(MODEL, Layout(tp=2, micro_batch_size=2, num_microbatches=3, recompute="full",
                                          sequence_parallel=True), cpu(), FP32, calibration=cal)
    assert sp.tp_communication == pytest.approx(time.tp_communication)


def test_a_block_timed_split_over_tp_replaces_the_even_split_and_its_modelled_collectives():
    tp_link = LinkSpeed(latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    # Split over 2 ranks the block takes 3e-6 s per token of the micro-batch, not the even 4e-6 / 2.
    cal = calibration(tp=tp_link, block={2: 4e-6}, tp_block_seconds_per_token={2: {2: 3e-6}})
    layout = Layout(tp=2, dp=4, micro_batch_size=2)
    tokens = 2 * MODEL.seq_length
    time = estimate_step_time(MODEL, layout, cpu(), FP32, calibration=cal)
    assert time.compute == pytest.approx(MODEL.num_layers * 4e-6 * tokens / 2 + 1e-7 * tokens / 2)
    # What the split adds counts as tp communication; only the embedding's and the head's regions are modelled.
    ends = 2 * tp_link.seconds(wire_bytes("all_reduce", tokens * MODEL.hidden_size * 4, 2), 2)
    assert time.tp_communication == pytest.approx(MODEL.num_layers * (3e-6 - 2e-6) * tokens + ends)
    # A tp size not timed keeps the model: the even split and four all-reduces per block.
    untimed = estimate_step_time(MODEL, Layout(tp=4, dp=2, micro_batch_size=2), cpu(), FP32, calibration=cal)
    assert untimed.tp_communication == pytest.approx((4 * MODEL.num_layers + 2) * tp_link.seconds(
        wire_bytes("all_reduce", tokens * MODEL.hidden_size * 4, 4), 6))


def test_latency_is_paid_once_per_ring_step_so_it_grows_with_the_group():
    link = LinkSpeed(latency_s=1e-3, bandwidth_bytes_per_s=1e9)
    assert [latency_steps("all_reduce", k) for k in (1, 2, 4, 8)] == [0, 2, 6, 14]
    assert [latency_steps(c, 8) for c in ("all_gather", "reduce_scatter", "send")] == [7, 7, 1]
    assert link.seconds(0.0, 14) == 0.0 and link.seconds(1e6, 14) == pytest.approx(14e-3 + 1e-3)
    # An all-reduce timed over 8 ranks (14 steps) gives the latency of one step.
    measured = LinkSpeed.fit(wire=(2**16, 2**22), seconds=(14e-3 + 2**16 / 1e9, 14e-3 + 2**22 / 1e9), steps=14)
    assert measured.latency_s == pytest.approx(1e-3) and measured.bandwidth_bytes_per_s == pytest.approx(1e9)
    small, large = (estimate_step_time(MODEL, Layout(tp=t, dp=8 // t, micro_batch_size=2), cpu(), FP32,
                                       calibration=calibration(tp=link)) for t in (2, 8))
    calls = 4 * MODEL.num_layers + 2
    assert large.tp_communication - small.tp_communication == pytest.approx(
        calls * (12 * link.latency_s + (wire_bytes("all_reduce", 2 * MODEL.seq_length * MODEL.hidden_size * 4, 8)
                                        - wire_bytes("all_reduce", 2 * MODEL.seq_length * MODEL.hidden_size * 4, 2))
                 / link.bandwidth_bytes_per_s))


def test_the_last_reduction_and_zeros_first_gather_stay_exposed_however_long_the_backward():
    # A block time long enough that every data-parallel call would fit behind the backward.
    dp_link = LinkSpeed(latency_s=1e-3, bandwidth_bytes_per_s=1e9)
    cal = calibration(dp=dp_link, block={8: 1e-3})
    params = rank_parameters(MODEL, Layout(dp=8), 0)
    grads = params * FP32.grad_bytes  # 32 MiB: two DDP buckets, the second reduced after the last backward
    ddp = estimate_step_time(MODEL, Layout(dp=8, micro_batch_size=8), cpu(), FP32, calibration=cal)
    assert ddp.dp_communication == pytest.approx(dp_link.seconds(wire_bytes("all_reduce", grads / 2, 8), 14))
    # ZeRO: FSDP units (each block, and the rest); the last unit's reduce-scatter and the first's gather.
    units = MODEL.num_layers + 1
    zero = estimate_step_time(MODEL, Layout(dp=8, micro_batch_size=8, zero_stage=2), cpu(), FP32, calibration=cal)
    assert zero.dp_communication == pytest.approx(
        dp_link.seconds(wire_bytes("reduce_scatter", grads / units, 8), 7)
        + dp_link.seconds(wire_bytes("all_gather", params * FP32.param_bytes / units, 8), 7))
    # Where communication cannot run beside compute (CPU ranks filling the cores), none of it is hidden.
    busy = replace(cal, host_cores_per_rank=1.0)
    serial = estimate_step_time(MODEL, Layout(dp=8, micro_batch_size=8, zero_stage=2), cpu(), FP32, calibration=busy)
    assert serial.dp_communication == pytest.approx(units * zero.dp_communication)


def test_where_ranks_outnumber_the_cores_a_pipeline_step_is_bounded_as_list_scheduling_is():
    layout = Layout(pp=4, dp=2, micro_batch_size=1, num_microbatches=4)
    own = estimate_step_time(MODEL, layout, cpu(), FP32, calibration=calibration())
    microbatch = own.compute / 4 + own.tp_communication / 4 + own.pp_communication / 4
    assert own.pp_bubble == pytest.approx(3 * microbatch)  # a core per rank: (p - 1) of the slowest stage's
    # Half a core per rank, 8 ranks: 4 cores, which go wherever there is work (Graham 1969). The step is the
    # ranks' average busy work at the shared pace plus (1 - 1/4) of the critical path -- 7 micro-batch times
    # of the slowest stage -- at a core per rank (twice the shared pace).
    half = estimate_step_time(MODEL, layout, cpu(), FP32, calibration=calibration(host_cores_per_rank=0.5))
    assert half.pp_bubble == pytest.approx((1 - 1 / 4) * 7 * microbatch * 0.5)
    # The average stage, not the slowest: the last stage's head (1e-7 s per token) is shared out over the 4.
    head = 4 * 1e-7 * MODEL.seq_length
    assert half.compute == pytest.approx(own.compute - head * 3 / 4)
    short = estimate_step_time(MODEL, Layout(pp=8, micro_batch_size=1, num_microbatches=8), cpu(), FP32,
                               calibration=calibration(host_cores_per_rank=0.9))
    full = estimate_step_time(MODEL, Layout(pp=8, micro_batch_size=1, num_microbatches=8), cpu(), FP32,
                              calibration=calibration())
    per_microbatch = (full.compute + full.tp_communication + full.pp_communication) / 8
    assert short.pp_bubble == pytest.approx((1 - 1 / 7.2) * (8 + 7) * per_microbatch * 0.9)


def test_without_a_calibration_a_cluster_with_no_peak_cannot_be_timed():
    with pytest.raises(PlannerError, match="give the planner a Calibration"):
        estimate_step_time(MODEL, Layout(dp=8), cpu(), FP32)


def test_without_a_calibration_step_times_are_the_datasheets_as_before():
    gpu = Cluster.preset("a100-40gb")
    layout = Layout(dp=2, tp=2, pp=2, num_microbatches=4, zero_stage=2, sequence_parallel=True)
    assert estimate_step_time(MODEL, layout, gpu, FP32) == estimate_step_time(MODEL, layout, gpu, FP32,
                                                                              calibration=None)
    assert evaluate(MODEL, layout, gpu, FP32).mfu > 0 and evaluate(MODEL, layout, cpu(), FP32,
                                                                   calibration=calibration()).mfu is None


# ----------------------------------------------------------------------------------------------- decisions


def best_layout(cluster=None, **kwargs):
    return plan(MODEL, cluster or cpu(), global_batch_size=32, precision=FP32, **kwargs).best.layout


def test_with_fast_links_a_small_model_trains_pure_data_parallel():
    layout = best_layout(calibration=calibration())
    assert (layout.dp, layout.tp, layout.pp, layout.recompute) == (8, 1, 1, None)


def test_a_slow_tensor_parallel_link_makes_the_planner_split_by_pipeline_and_a_slow_pipeline_link_by_tp():
    # Model parallel over all 8 ranks (dp held at 1): which of tp and pp carries the split depends on the links.
    slow_tp = plan(MODEL, cpu(), global_batch_size=32, precision=FP32, calibration=calibration(tp=SLOW),
                   fixed={"dp": 1})
    slow_pp = plan(MODEL, cpu(), global_batch_size=32, precision=FP32, calibration=calibration(pp=SLOW),
                   fixed={"dp": 1})
    assert (slow_tp.best.layout.tp, slow_tp.best.layout.pp) == (1, 8)
    assert (slow_pp.best.layout.tp, slow_pp.best.layout.pp) == (8, 1)
    # Why: against the best layout that splits the ranks otherwise, the link that is slow.
    assert "less tensor-parallel communication" in slow_tp.why()
    assert "less pipeline sends" in slow_pp.why()


# The two ways memory runs out, on one host's 8 ranks. The data-parallel link is fast but each call costs
# 1 ms (ZeRO makes two per block, DDP one per 25 MiB), and the optimizer step little, so that with room to
# spare plain data parallelism is the fastest.
STATES_HEAVY = ModelSpec(num_layers=8, hidden_size=512, num_heads=8, vocab_size=4096, seq_length=64)
"""27M parameters: 0.4 GiB of fp32 Adam states against a few MiB of activations."""
ACTIVATIONS_HEAVY = ModelSpec(num_layers=8, hidden_size=128, num_heads=4, vocab_size=4096, seq_length=2048)
"""2M parameters, 2048 tokens a sequence: the activations dominate."""


@pytest.mark.parametrize("model", [STATES_HEAVY, ACTIVATIONS_HEAVY], ids=["states", "activations"])
def test_a_tight_memory_budget_makes_the_planner_shard_or_recompute_and_stay_within_it(model):
    # dp: 1 ms per all-reduce over the 8 ranks (14 ring steps). The schedule's own work per chunk and
    # micro-batch, which a launch measures, at 0.5 ms: left at 0, 4 chunks per rank cost nothing here and
    # dp2 tp2 pp2 v4 comes out 0.2 % faster than dp8.
    cal = replace(calibration(dp=LinkSpeed(latency_s=1e-3 / 14, bandwidth_bytes_per_s=1e11), optimizer=1e-11,
                              block={1: 2e-5}), pipeline_microbatch_s=5e-4)
    fixed = {"micro_batch_size": 1}  # one lever less: smaller micro-batches would also save activations
    generous = plan(model, cpu(8.0), global_batch_size=32, precision=FP32, calibration=cal, fixed=fixed)
    fastest = generous.best.layout
    assert (fastest.dp, fastest.recompute) == (8, None)
    budget = 0.6 * generous.best.memory.total  # the fastest layout no longer fits
    tight = plan(model, cpu(budget / GIB), global_batch_size=32, precision=FP32, calibration=cal, fixed=fixed)
    chosen = tight.best.layout
    assert tight.best.memory.total <= budget
    if model is STATES_HEAVY:  # shard the model states: ZeRO, or the model over tp or pp
        assert fastest.zero_stage == 0 and (chosen.zero_stage > 0 or chosen.tp > 1 or chosen.pp > 1)
    else:  # fewer activations per rank: recompute them, or split the blocks over pp or tp
        assert chosen.recompute or chosen.pp > 1 or chosen.tp > 1
    unfit = tight.fastest_unfit  # named in the why line: the faster layout that did not fit
    assert unfit.time.total == pytest.approx(generous.best.time.total) and unfit.memory.total > budget
    assert f"{unfit.layout.describe()} (" in tight.why() and "usable" in tight.why()


def test_a_budget_nothing_fits_raises_with_the_smallest_memory_any_layout_needs():
    every = [evaluate(MODEL, layout, cpu(), FP32, calibration=calibration())
             for layout in enumerate_layouts(MODEL, 8, 8, 32)]
    with pytest.raises(NoLayoutFits) as error:
        plan(MODEL, cpu(0.001), global_batch_size=32, precision=FP32, calibration=calibration())
    assert error.value.smallest_bytes == min(c.memory.total for c in every)
    assert f"The smallest need is {error.value.smallest_bytes / GIB:.3g} GiB per rank" in str(error.value)
    # Held settings are named, and the smallest need is that of the layouts they allow.
    with pytest.raises(NoLayoutFits, match="with tp=1, zero_stage=0") as held:
        plan(MODEL, cpu(0.001), global_batch_size=32, precision=FP32, calibration=calibration(),
             fixed={"tp": 1, "zero_stage": 0})
    assert held.value.smallest_bytes > error.value.smallest_bytes


def test_fixed_fields_are_held_and_unknown_ones_refused():
    result = plan(MODEL, cpu(), global_batch_size=32, precision=FP32, calibration=calibration(),
                  fixed={"tp": 2, "recompute": "full", "sequence_parallel": False})
    assert {(c.layout.tp, c.layout.recompute, c.layout.sequence_parallel) for c in result.candidates} == {
        (2, "full", False)}
    with pytest.raises(PlannerError, match=r"\['tensor_parallel_size'\], which are not Layout fields"):
        plan(MODEL, cpu(), global_batch_size=32, calibration=calibration(), fixed={"tensor_parallel_size": 2})


def test_summary_lists_the_top_layouts_and_why_the_first_won():
    result = plan(MODEL, cpu(), global_batch_size=32, precision=FP32, calibration=calibration(dp=SLOW))
    lines = result.summary(3).splitlines()
    assert "calibrated on these devices" in lines[0] and len(lines) == 5
    assert lines[1].startswith(f"  1. {result.best.layout.describe()}: step")
    assert lines[4].startswith(f"  why: {result.best.layout.describe()} is ") and "faster per token than" in lines[4]
    assert result.top(2) == result.candidates[:2]
    table = result.table(3)
    assert "8 ranks" in table and "times from measured speeds" in table and table.splitlines()[1].endswith("MFU")
    assert table.splitlines()[2].endswith(" -")  # no peak, no MFU
    assert "accelerator: cpu" in result.to_yaml()


def test_a_block_called_with_a_cache_object_is_timed_with_a_fresh_copy_each_call():
    """layout='auto' on a model from transformers (Phi-3, Llama: use_cache defaults to True) failed in the
    calibration with "Trying to backward through the graph a second time": the decoder layer appends its keys
    to the DynamicCache it is called with, and the timing reused the captured one across calls."""
    import torch

    from lightning_3d.strategies import calibrate

    class Cache:  # as a DynamicCache: the layer appends to it and reads all of it
        def __init__(self) -> None:
            self.keys: list[torch.Tensor] = []

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, hidden, past_key_values=None):
            past_key_values.keys.append(self.proj(hidden))
            return hidden + torch.stack(past_key_values.keys).sum(0)

    call = ((torch.empty(2, 3, 4, device="meta"),), {"past_key_values": Cache()})
    seconds = calibrate.block_seconds_per_token(Layer(), call, 2, [1, 2], torch.device("cpu"), repeat_s=0.001)
    assert set(seconds) == {1, 2} and all(0 < t < 1 for t in seconds.values())
    assert call[1]["past_key_values"].keys == []  # the captured object itself is never used
