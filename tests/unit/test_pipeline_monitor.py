"""PipelineMonitor in one process: the theoretical bubble, its measurement on recorded actions, the timeline
picture and trace, CUDA event timing, a run with no pipeline (on 2 real ranks:
parity/test_pipeline_monitor_on_ranks.py)."""

import json
import sys

import pytest
import torch

from lightning_3d.callbacks.pipeline_monitor import bubble_title, chrome_trace, measured_bubble, theoretical_bubble
from lightning_3d.callbacks.timeline_image import (BACKGROUND, COLORS, draw_timeline, figure_height, shade,
                                                    timeline_figure)
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


def test_without_matplotlib_the_picture_is_drawn_by_hand_with_a_row_per_stage_and_the_bubble(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    image = draw_timeline(ideal_1f1b_two_stages(), width=609)  # 100 px per time unit
    assert image.shape == (62, 609, 3) and str(image.dtype) == "torch.uint8"
    row0, row1 = image[4 + 12], image[4 + 24 + 6 + 12]  # the middle pixel line of each row
    assert (row0[4 + 50] == BACKGROUND).logical_not().any()  # stage 0 computes at t=0.5 ...
    assert (row1[4 + 50] == BACKGROUND).all()  # ... while stage 1 waits: the bubble
    assert tuple(row0[4 + 50].tolist()) == COLORS["F"] and tuple(row1[4 + 250].tolist()) == COLORS["B"]


def test_the_matplotlib_picture_names_stages_micro_batches_and_both_bubbles():
    rows = ideal_1f1b_two_stages()
    title = bubble_title(measured_bubble(rows), theoretical_bubble("1f1b", 2, 2), "1f1b", pp=2, microbatches=2)
    assert title == "measured bubble 33% vs theoretical 33% (1f1b, pp=2, m=2)"
    fig = timeline_figure(rows, width=800, ranks=[4, 6], title=title)  # e.g. the pipeline of dp rank 1 of 2
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0 (rank 4)", "stage 1 (rank 6)"]
    assert sorted(t.get_text() for t in ax.texts) == ["0"] * 4 + ["1"] * 4  # one number per bar
    assert ax.get_title() == title
    assert "ms" in ax.get_xlabel() and ax.get_xlim() == pytest.approx((0, 6e3))  # the synthetic units are seconds
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]

    image = draw_timeline(rows, width=800, ranks=[4, 6], title=title)
    assert image.shape == (figure_height(2), 800, 3) and str(image.dtype) == "torch.uint8"
    colors = {tuple(c) for c in image.reshape(-1, 3).tolist()}
    assert {(BACKGROUND,) * 3, COLORS["F"], COLORS["B"]} <= colors and len(colors) > 20  # bars, text, axes


def test_virtual_stages_share_their_rank_s_row_and_are_shaded_by_their_place():
    rows = [[Action(0, "F", 0, 0, 1), Action(2, "F", 0, 2, 3)], [Action(1, "F", 0, 1, 2), Action(3, "F", 0, 3, 4)]]
    (ax,) = timeline_figure(rows).axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stages 0, 2 (rank 0)", "stages 1, 3 (rank 1)"]
    # a rank's second stage is one shade darker, whatever pp puts between the stage numbers
    faces = [tuple(round(c * 255) for c in face[:3]) for face in ax.collections[0].get_facecolor()]
    assert faces == [shade(rows[0][0], 0), shade(rows[0][1], 1)] and faces[0] == COLORS["F"] != faces[1]


def test_the_trace_has_one_event_per_action_with_rank_stage_and_microseconds(tmp_path):
    stage0, stage1 = ideal_1f1b_two_stages()
    stage1 = [a._replace(start=a.start + 100.0, end=a.end + 100.0) for a in stage1]  # as wall-clock times
    stage0 = [a._replace(start=a.start + 100.0, end=a.end + 100.0) for a in stage0]
    path = tmp_path / "step.json"
    path.write_text(json.dumps(chrome_trace({0: stage0, 1: stage1})))
    events = json.loads(path.read_text())["traceEvents"]
    actions = [e for e in events if e["ph"] == "X"]
    assert len(actions) == 8
    by_name = {(e["pid"], e["tid"], e["name"]): (e["ts"], e["dur"]) for e in actions}
    assert by_name[(0, 0, "F0")] == pytest.approx((0.0, 1e6))  # microseconds from the step's first action
    assert by_name[(0, 0, "B1")] == pytest.approx((5e6, 1e6))
    assert by_name[(1, 1, "F1")] == pytest.approx((3e6, 1e6))
    names = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert names == {(0, None, "rank 0"), (1, None, "rank 1"), (0, 0, "stage 0"), (1, 1, "stage 1")}


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
