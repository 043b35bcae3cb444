"""What layout='auto''s calibration does to device memory (issue 53): the budget is read before the calibration
allocates anything, and what it allocated is handed back to the device after it (``torch.cuda.empty_cache``
on CUDA; nothing on CPU). One process, no group."""

import pytest
import torch

from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner.model import ModelSpec
from lightning_3d.strategies import auto_layout, calibrate_timing

CPU = torch.device("cpu")
SPEC = ModelSpec(num_layers=2, hidden_size=8, num_heads=1, vocab_size=32, seq_length=4)


class Stop(Exception):
    """Ends the decision after the calibration: what follows it is not under test."""


def decide_in_order(monkeypatch, *, measure_fails: bool = False) -> list[str]:
    order = []

    def measure(*_args, **_kwargs):
        order.append("calibration")
        if measure_fails:
            raise RuntimeError("out of memory")
        raise Stop

    monkeypatch.setattr(auto_layout, "memory_per_rank", lambda *_: order.append("budget") or 1e9)
    monkeypatch.setattr(auto_layout, "measure", measure)
    monkeypatch.setattr(auto_layout, "release_device_memory", lambda device: order.append(f"release {device}"))
    with pytest.raises((Stop, RuntimeError)):
        auto_layout.decide(ParallelConfig(layout="auto"), module=None, spec=SPEC, blocks=["b"], tp_plans={},
                           batch=torch.zeros(2, 4), precision_name="32-true", world_size=1, per_node=1, device=CPU)
    return order


def test_the_budget_is_read_before_the_calibration_and_its_memory_released_after(monkeypatch):
    assert decide_in_order(monkeypatch) == ["budget", "calibration", "release cpu"]


def test_a_calibration_that_fails_still_releases_what_it_allocated(monkeypatch):
    assert decide_in_order(monkeypatch, measure_fails=True) == ["budget", "calibration", "release cpu"]


@pytest.mark.parametrize("device, emptied", [("cuda", True), ("cpu", False)])
def test_releasing_empties_the_cuda_caching_allocator_and_is_a_no_op_on_cpu(monkeypatch, device, emptied):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    calibrate_timing.release_device_memory(torch.device(device))
    assert calls == (["empty_cache"] if emptied else [])
