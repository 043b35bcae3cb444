"""SIGTERM stops every rank at the same batch, with Lightning's SIGTERMException, and with no collective from
the signal handler (strategies/stop_signal.py): the signal sent to rank 1 only, then to rank 0 only, in a
pipelined fit on 2 ranks; a fit after them in the same processes runs to its end. Lightning's own check heard
rank 0 only, and its handler broadcast on the default group, which the other rank met in another collective."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun

pytestmark = pytest.mark.multiprocess

SIGNALLED = ["1", "0"]


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("stop_signal")
    forkrun(2, str(WORKERS / "stop_signal_worker.py"), str(out), *SIGNALLED, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("which", range(len(SIGNALLED)))
def test_sigterm_on_one_rank_stops_every_rank_one_batch_later(fits, which):
    # The signal arrives after batch 2; the check before batch 3 posts it; the check before batch 4 stops.
    for rank_fits in fits:
        interrupted = rank_fits[which]
        assert interrupted["signalled_rank"] == int(SIGNALLED[which])
        assert interrupted["ended"] == "SIGTERMException", interrupted
        assert interrupted["started"] == [0, 1, 2, 3], interrupted


def test_a_later_fit_in_the_same_processes_runs_to_its_end(fits):
    for rank_fits in fits:
        last = rank_fits[-1]
        assert last["ended"] is None and last["started"] == list(range(8)), last
        assert all(fit["handler_restored"] for fit in rank_fits), rank_fits
