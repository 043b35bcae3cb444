"""``benchmarks/layout_sweep.py`` predicts each fit with the two calibrations taken nearest before and after it,
interpolated by time (the host's pace drifts over the minutes between auto's fits); the script itself needs 8
ranks and 20-25 minutes and is not run here."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_3d.planner import Calibration, LinkSpeed
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.model import ModelSpec
from lightning_3d.models import GPTConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_sweep():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its neighbour ``timing``
    try:
        spec = importlib.util.spec_from_file_location("layout_sweep", BENCHMARKS / "layout_sweep.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["layout_sweep"] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


sweep = _load_sweep()
SPEC = ModelSpec.from_gpt_config(GPTConfig(n_layer=4, n_embd=64, n_head=8, vocab_size=256, block_size=64),
                                 seq_length=64)
LAYOUT = Layout(dp=4, tp=1, pp=2, micro_batch_size=2, num_microbatches=4, schedule="1f1b")


def calibrated(at: float, block_seconds: float):
    link = LinkSpeed(latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    calibration = Calibration(block_seconds_per_token={1: block_seconds}, head_seconds_per_token=1e-6,
                              tp=link, pp=link, dp=link)
    return sweep.Calibrated(at, SimpleNamespace(calibration=calibration, memory_per_rank=GIB))


def test_a_fit_is_predicted_between_the_calibrations_bracketing_it_by_time():
    slow, fast = calibrated(100.0, 4e-5), calibrated(200.0, 1e-5)
    alone = {c.at: sweep.bracketed_prediction(SPEC, LAYOUT, [c], 0.0)[0] for c in (slow, fast)}
    assert alone[100.0] > 2 * alone[200.0]  # the two calibrations predict far apart
    calibrations = [fast, slow]  # in any order
    step = {at: sweep.bracketed_prediction(SPEC, LAYOUT, calibrations, at)[0] for at in (50, 100, 125, 200, 300)}
    assert step[50] == pytest.approx(alone[100.0]) and step[100] == pytest.approx(alone[100.0])  # before: the first
    assert step[125] == pytest.approx(0.75 * alone[100.0] + 0.25 * alone[200.0])
    assert step[200] == pytest.approx(alone[200.0]) and step[300] == pytest.approx(alone[200.0])  # after: the last


def test_the_prediction_is_split_by_cause_and_the_parts_add_up():
    calibrations = [calibrated(0.0, 4e-5), calibrated(10.0, 1e-5)]
    seconds, parts, memory = sweep.bracketed_prediction(SPEC, LAYOUT, calibrations, 5.0)
    assert set(parts) == {"compute", "tp_communication", "pp_bubble", "pp_communication", "dp_communication",
                          "optimizer"}
    assert sum(parts.values()) == pytest.approx(seconds) and parts["compute"] > 0 and parts["pp_bubble"] > 0
    assert memory > 0
