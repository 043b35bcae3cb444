"""PipelineMonitor on 2 real ranks (helpers/workers/pipeline_monitor_worker.py): no host read of a tensor inside
the schedule, the recorded 1F1B and zero-bubble orders, the measured bubble near its theory, the timeline
image in TensorBoard and rank 0's trace of every rank's actions."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun
from lightning_3d.callbacks.timeline_image import BACKGROUND, COLORS, figure_height


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_monitor")
    forkrun(2, str(WORKERS / "pipeline_monitor_worker.py"), str(out), rank_files=out, timeout=300)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.multiprocess
def test_a_pipelined_step_reads_no_tensor_value_on_the_host_inside_the_schedule(pipeline_run):
    # On CUDA each such read (int(t), t.item(), if t:) would stop the host until the device catches up, in the
    # middle of the schedule. Recorded on every rank, in every step but the first, zero-bubble and 1F1B.
    assert [rank["host_conversions_in_schedules"] for rank in pipeline_run] == [[], []]


@pytest.mark.multiprocess
def test_the_recorded_actions_are_the_1f1b_order_of_each_stage(pipeline_run):
    rows = pipeline_run[0]["rows"]
    order = [[f"{kind}{mb}" for _, kind, mb, _, _ in row] for row in rows]
    assert order == [["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],  # stage 0: one warm-up forward
                     ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]]  # the last stage: steady state at once
    (_, _, _, _, first_forward_end), (_, _, _, second_stage_start, _) = rows[0][0], rows[1][0]
    assert second_stage_start >= first_forward_end  # stage 1 waited for stage 0's activations


@pytest.mark.multiprocess
def test_zero_bubble_records_weight_gradients_on_two_virtual_stages_per_rank(pipeline_run):
    rows = pipeline_run[0]["zero_bubble_rows"]
    assert [sorted({stage for stage, *_ in row}) for row in rows] == [[0, 2], [1, 3]]  # the looped placement
    for row in rows:
        kinds = [kind for _, kind, *_ in row]
        assert kinds.count("F") == kinds.count("B") == kinds.count("W") == 2 * 4  # 2 stages x 4 micro-batches


@pytest.mark.multiprocess
def test_measured_bubble_of_1f1b_is_near_its_theory(pipeline_run):
    logged = pipeline_run[0]["logged"]
    assert logged == pipeline_run[1]["logged"]  # every rank logs the same values
    assert logged["pipeline/bubble_theory"] == pytest.approx(1 / 5)  # pp=2, 4 micro-batches
    # Real steps idle more than the ideal (gloo's send/receive, the last stage's heavier head, a shared CPU),
    # but a pipeline with no bubble, or mostly bubble, would mean the timing is wrong.
    assert 0.1 <= logged["pipeline/bubble_measured"] <= 0.6, logged


@pytest.mark.multiprocess
def test_the_timeline_image_reaches_tensorboard(pipeline_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = pipeline_run[0]
    assert result["image_shape"] == [figure_height(2), 800, 3]  # two rows, 800 px wide
    assert result["title"].startswith("measured bubble ") and result["title"].endswith(" (1f1b, pp=2, m=4)")
    colors = {tuple(c) for c in result["image_colors"]}
    assert {(BACKGROUND,) * 3, COLORS["F"], COLORS["B"]} <= colors
    events = EventAccumulator(result["log_dir"], size_guidance={"images": 0})
    events.Reload()
    assert "pipeline/timeline" in events.Tags()["images"]
    # batches 2 and 4, logged after their optimizer steps
    assert [e.step for e in events.Images("pipeline/timeline")] == [3, 5]


@pytest.mark.multiprocess
def test_rank_0_writes_every_rank_s_actions_as_a_trace_per_recorded_step(pipeline_run):
    traces = pipeline_run[0]["traces"]
    assert sorted(traces) == ["pipeline_step3.json", "pipeline_step5.json"]  # batches 2 and 4, as the images
    actions = [e for e in traces["pipeline_step5.json"]["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["tid"]) for e in actions) == [(0, 0)] * 8 + [(1, 1)] * 8
    assert [e["name"] for e in actions if e["pid"] == 0] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
