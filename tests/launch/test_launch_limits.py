"""A launch's time limit catches a hang, not a slow machine (helpers/launchers.py ``Progress``): past its
timeout a launch goes on while its processes use CPU, and is killed once they stop using any, or at the hard
cap."""

import sys
import time

import pytest

from helpers.launchers import LaunchHung, Progress, run_to_end

BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


@pytest.fixture
def short_limits(monkeypatch):
    monkeypatch.setattr(Progress, "STALL_S", 1.5)
    monkeypatch.setattr(Progress, "HARD_CAP", 8)


def test_a_launch_still_working_past_its_timeout_is_left_to_finish(short_limits):
    # Judged from 4 s on, past the interpreter's start-up: on a loaded host a start waiting on the disk uses almost
    # no CPU, which a shorter timeout would judge a hang.
    proc = run_to_end([sys.executable, "-c", BUSY.format(seconds=10)], env={}, timeout=4)
    assert proc.returncode == 0


def test_a_launch_that_uses_no_cpu_past_its_timeout_is_killed_as_hung(short_limits):
    started = time.monotonic()
    with pytest.raises(LaunchHung, match=r"used 0\.\d\d s of CPU in the last \d+ s: hung"):
        run_to_end([sys.executable, "-c", "import time; time.sleep(600)"], env={}, timeout=1)
    assert time.monotonic() - started < 30


def test_a_launch_that_spins_forever_is_killed_at_the_hard_cap(short_limits):
    started = time.monotonic()
    with pytest.raises(LaunchHung, match=r"still running after \d+ s \(8 x its timeout of 0.5 s\)"):
        run_to_end([sys.executable, "-c", BUSY.format(seconds=600)], env={}, timeout=0.5)
    assert time.monotonic() - started < 30
