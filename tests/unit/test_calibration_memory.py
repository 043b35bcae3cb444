"""What layout='auto''s calibration does to device memory (issue 53): the budget is read before the calibration
allocates anything, what it allocated is handed back to the device after it (``torch.cuda.empty_cache`` on
CUDA; nothing on CPU), and the head is timed on a bounded number of tokens, its time per token scaled to the
run's micro-batch. One process (a one-rank group for the split head)."""

import pytest
import torch

from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner.model import ModelSpec
from lightning_3d.strategies import auto_layout, calibrate, calibrate_timing

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


def head_timed(monkeypatch, time_head) -> tuple[set, object]:
    """The token counts the head's matmul saw while ``time_head()`` ran, with each timing taking one second,
    and what ``time_head()`` returned; at most 64 logits per token of a 32-word vocabulary."""
    seen = set()
    real_linear = torch.nn.functional.linear

    def linear(x, weight, *args):
        seen.add(x.shape[0])
        return real_linear(x, weight, *args)

    monkeypatch.setattr(calibrate, "HEAD_PROBE_LOGITS", 64 * 32)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(calibrate, "median_seconds", lambda run, *a, **k: run() or 1.0)
    return seen, time_head()


def test_the_head_of_a_huge_micro_batch_is_timed_on_the_bound_and_scaled_per_token(monkeypatch):
    seen, per_token = head_timed(monkeypatch, lambda: calibrate.head_seconds_per_token(8, 32, 10**6, CPU))
    assert seen == {64} and per_token == 1.0 / 64


def test_the_split_head_of_a_huge_micro_batch_is_timed_on_the_bound_and_scaled_per_token(monkeypatch):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest
    seen, times = head_timed(monkeypatch, lambda: calibrate.tp_head_seconds_per_token(8, 32, 8192, [1, 4], [1],
                                                                                      CPU))
    assert seen == {64} and times == {1: {1: 1.0 / 64, 4: 1.0 / 64}}


def test_a_micro_batch_within_the_bound_is_timed_whole():
    assert calibrate.head_probe_tokens(512, 32_000) == 512
    assert calibrate.head_probe_tokens(4 * 8192, 128_256 // 2) == calibrate.HEAD_PROBE_LOGITS // (128_256 // 2)
    assert calibrate.head_probe_tokens(8, 10**9) == 1
