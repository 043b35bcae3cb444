"""A pipelined step holds its stage's gradients once, not twice (issue 28's step memory): Lightning zeroes the
gradients after training_step, but the schedule has already run backward inside it, so the engine keeps this
step's gradients aside (``PipelineEngine.training_step``). The previous step's, which Lightning is about to
zero, used to be kept beside them through the whole schedule: at 1.1B at (1, 2, 2) a step's peak rose 1428 MiB
over what stays between steps where the planner says 1283 (``benchmarks/setup_rehearsal.py``). When
accumulating, the previous micro-step's gradients are still needed and kept."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def lifetimes(tmp_path_factory):
    out = tmp_path_factory.mktemp("grad_lifetime")
    forkrun(2, str(WORKERS / "grad_lifetime_worker.py"), str(out), rank_files=out, timeout=300)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_the_previous_step_s_gradients_are_gone_while_the_schedule_runs(lifetimes):
    assert [rank["no_accumulation"] for rank in lifetimes] == [{"1": False}, {"1": False}]


def test_accumulated_gradients_stay_until_the_window_ends(lifetimes):
    # Batches 0-1 and 2-3 are the two windows: batch 1 adds to batch 0's, batch 2 starts afresh, batch 3 adds.
    assert [rank["accumulate_2"] for rank in lifetimes] == [{"1": True, "2": False, "3": True}] * 2
