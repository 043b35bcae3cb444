"""After the first step, a training step runs no Python mode around the model and reads no device value on the
host (issue 30): modes on the stack while blocks run forward and backward at steps 2-4, and host syncs plus
object collectives at steps 5-7 -- Lightning's SIGTERM check before each batch included, which read a broadcast
device flag with .item() until the strategy took its place (strategies/stop_signal.py) -- at pp=2 and tp=2
(helpers/workers/steady_state_worker.py), one launch. With
lightning_3d's callbacks logging every step (PipelineMonitor at pp=2 only), none either: NaNGuard reads its
agreement on whether any rank saw a NaN at the next step, from a copy made on the way (it read it with .item()
before every optimizer step; there were 14 syncs at pp=2 and 11 at tp=2 when the callbacks read each metric
with .item() and PipelineMonitor pickled its timeline). The monitors' .tolist() reads of what they log are
counted apart (``copies``), not asserted."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun

pytestmark = pytest.mark.multiprocess

LAYOUTS = ["pp2", "tp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("steady_state")
    forkrun(2, str(WORKERS / "steady_state_worker.py"), str(out), *LAYOUTS, timeout=300)
    return {(layout, kind): json.loads((out / f"{layout}_{kind}.json").read_text())
            for layout in LAYOUTS for kind in ("bare", "default", "monitors")}


@pytest.mark.parametrize("kind", ["bare", "default"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_host_sync_and_no_object_collective_in_a_steady_state_step(results, layout, kind):
    result = results[(layout, kind)]
    for rank, per_step in enumerate(result["syncs"]):
        assert len(per_step) == 3 and all(count == 0 for count in per_step.values()), (rank, per_step, result["where"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_callbacks_do_not_sync_the_host_in_a_step_that_logs(results, layout):
    result = results[(layout, "monitors")]
    for rank, per_step in enumerate(result["syncs"]):
        assert len(per_step) == 3 and all(count == 0 for count in per_step.values()), (rank, per_step, result["where"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_mode_is_active_while_blocks_run_after_the_first_step(results, layout):
    result = results[(layout, "bare")]
    assert result["blocks_seen"] > 0
    assert result["modes"] == {step: [0, 0] for step in ("1", "2", "3")}, result["modes"]
