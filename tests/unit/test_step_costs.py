"""StepCosts, the engine's per-part timing of its last step, on a fake clock."""

import pytest

from lightning_3d.pipeline import step_costs
from lightning_3d.pipeline.step_costs import StepCosts


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: now[0])
    return now


def test_each_part_keeps_its_own_time_without_the_parts_inside_it(clock):
    costs = StepCosts()
    with costs.step():
        clock[0] += 1  # bookkeeping
        with costs.part("schedule"):
            clock[0] += 10
            with costs.part("user_loss"):
                clock[0] += 3
            clock[0] += 10
        with costs.part("sharing"):
            clock[0] += 2
    assert costs.seconds == {"bookkeeping": 1, "schedule": 20, "user_loss": 3, "sharing": 2}


def test_a_step_inside_a_step_is_the_same_step_and_a_new_one_starts_afresh(clock):
    costs = StepCosts()
    with costs.step():  # training_step
        clock[0] += 1
        with costs.step():  # run, called by it
            with costs.part("capture"):
                clock[0] += 4
    with costs.part("bookkeeping"):  # add_step_grads, after training_step: still the same step
        clock[0] += 1
    assert costs.seconds == {"bookkeeping": 2, "capture": 4}
    with costs.step():
        clock[0] += 5
    assert costs.seconds == {"bookkeeping": 5}
