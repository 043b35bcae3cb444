"""PipelineMonitor: theory and measurement of the bubble, the recorded 1F1B order, the TensorBoard picture."""

import json
from pathlib import Path

import pytest
import torch

from harness import torchrun
from lightning_3d.callbacks.pipeline_monitor import measured_bubble, theoretical_bubble
from lightning_3d.callbacks.timeline_image import BACKGROUND, COLORS, draw_timeline
from lightning_3d.pipeline.timeline import Action, PipelineTimeline


def test_theoretical_bubbles_of_the_schedules():
    assert theoretical_bubble("1f1b", pp=2, microbatches=4) == pytest.approx(1 / 5)
    assert theoretical_bubble("gpipe", pp=4, microbatches=8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved_1f1b", pp=4, microbatches=8, virtual=2) == pytest.approx(3 / 19)
    assert theoretical_bubble("zero_bubble", pp=4, microbatches=8, virtual=2) == pytest.approx(3 / 51)
    with pytest.raises(ValueError, match="pipeline_schedule='looped_bfs'"):
        theoretical_bubble("looped_bfs", pp=2, microbatches=2)


def ideal_1f1b_two_stages() -> list[list[Action]]:
    """pp=2, two micro-batches, forward and backward one time unit each, communication free."""
    stage0 = [Action(0, "F", 0, 0, 1), Action(0, "F", 1, 1, 2), Action(0, "B", 0, 3, 4), Action(0, "B", 1, 5, 6)]
    stage1 = [Action(1, "F", 0, 1, 2), Action(1, "B", 0, 2, 3), Action(1, "F", 1, 3, 4), Action(1, "B", 1, 4, 5)]
    return [stage0, stage1]


def test_an_ideal_pipeline_measures_its_theoretical_bubble():
    assert measured_bubble(ideal_1f1b_two_stages()) == pytest.approx(theoretical_bubble("1f1b", 2, 2))


def test_the_timeline_picture_has_a_row_per_stage_and_shows_the_bubble():
    image = draw_timeline(ideal_1f1b_two_stages(), width=609)  # 100 px per time unit
    assert image.shape == (62, 609, 3) and str(image.dtype) == "torch.uint8"
    row0, row1 = image[4 + 12], image[4 + 24 + 6 + 12]  # the middle pixel line of each row
    assert (row0[4 + 50] == BACKGROUND).logical_not().any()  # stage 0 computes at t=0.5 ...
    assert (row1[4 + 50] == BACKGROUND).all()  # ... while stage 1 waits: the bubble
    assert tuple(row0[4 + 50].tolist()) == COLORS["F"] and tuple(row1[4 + 250].tolist()) == COLORS["B"]


class FakeCudaEvent:
    """Stands in for torch.cuda.Event on a machine without a GPU: "records" the host clock (ms)."""

    clock = [0.0]

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self) -> None:
        self.at = self.clock[0]

    def elapsed_time(self, end: "FakeCudaEvent") -> float:
        return end.at - self.at


def test_on_cuda_actions_are_timed_by_events_with_no_device_sync_between_them(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    timeline = PipelineTimeline(torch.device("cuda", 0))
    timeline.start()
    for kind, duration_ms in (("F", 30.0), ("B", 50.0)):
        with timeline.action(0, kind, 0):
            FakeCudaEvent.clock[0] += duration_ms
        FakeCudaEvent.clock[0] += 10.0  # waiting between actions
    assert len(syncs) == 1  # at start only: nothing stops the host between actions
    (forward, backward) = timeline.stop()
    assert len(syncs) == 2  # and once to read the events
    assert forward[:3] == (0, "F", 0) and backward[:3] == (0, "B", 0)
    assert forward.end - forward.start == pytest.approx(0.030) and backward.end - backward.start == pytest.approx(0.050)
    assert backward.start - forward.end == pytest.approx(0.010)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_monitor")
    torchrun(2, str(Path(__file__).parent / "pipeline_monitor_worker.py"), str(out), rank_files=out, timeout=300)
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
    assert result["image_shape"] == [62, 800, 3]  # two rows of 24 px, 800 px of time
    colors = {tuple(c) for c in result["image_colors"]}
    assert {(BACKGROUND,) * 3, COLORS["F"], COLORS["B"]} <= colors
    events = EventAccumulator(result["log_dir"], size_guidance={"images": 0})
    events.Reload()
    assert "pipeline/timeline" in events.Tags()["images"]
    # batches 2 and 4, logged after their optimizer steps
    assert [e.step for e in events.Images("pipeline/timeline")] == [3, 5]


def test_without_a_pipeline_it_says_so_and_logs_nothing(tmp_path):
    import lightning as L

    from lightning_3d.callbacks import PipelineMonitor
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[PipelineMonitor(every_n_steps=1)], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="PipelineMonitor has nothing to watch"):
        trainer.fit(GPTLightningModule(config=GPTConfig(n_layer=1, n_embd=32, block_size=16)),
                    SyntheticDataModule(seq_len=16, batch_size=2))
    assert not any(k.startswith("pipeline/") for k in trainer.callback_metrics)
