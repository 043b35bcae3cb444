"""A finished rank exits 0, never aborts at the interpreter's exit (issue 55): the fault watch's thread is
stopped and joined before the interpreter finalizes, or its rank is reported and exits non-zero."""

import subprocess
import sys
import threading
import time

import torch.distributed as dist

from lightning_3d.faults.watch import FaultWatch, Phase

# A rank's process in miniature: a real TCP store and a watch that polls it without pause, so that its thread
# is nearly always inside a call to the store -- where, left running at exit, CPython's end of a daemon thread
# aborts the process ("terminate called without an active exception"; 20 of 20 runs of such a script).
RANK = """
import time
import torch.distributed as dist
from lightning_3d.faults.watch import FaultWatch, Phase
store = dist.TCPStore("127.0.0.1", 0, 1, True)
watch = FaultWatch(store, 0, 1, lambda r: f"rank {r}", Phase("training", None), exit_timeout_s=30)
watch.poll_s = 1e-5
watch.start()
time.sleep(0.2)
"""


def _run_ranks(count: int = 4) -> list[subprocess.CompletedProcess]:
    """``count`` such processes at once (a torch import each: seconds)."""
    procs = [subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(count)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


def test_a_fault_watch_left_running_is_stopped_at_the_interpreters_exit():
    # (FaultWatch.stop() at the strategy's teardown joins the thread the same way: the test below.)
    for proc in _run_ranks():
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr)


class StuckStore(dist.Store):
    """A store whose reads do not return until ``release``, as one whose host stopped answering."""

    def __init__(self) -> None:
        super().__init__()
        self.reading, self.released = threading.Event(), threading.Event()

    def check(self, keys):
        self.reading.set()
        self.released.wait()
        return False


def test_a_fault_watch_that_cannot_stop_is_reported_by_name_and_ends_its_rank():
    store = StuckStore()
    watch = FaultWatch(store, 3, 4, lambda r: f"rank {r} (dp=0, pp=1, tp=1)", Phase("training", None),
                       exit_timeout_s=0.5)
    exits = []
    watch._exit = lambda report, printed=False: exits.append(report)  # instead of ending this process
    watch.start()
    try:
        assert store.reading.wait(10)
        started = time.monotonic()
        watch.stop()
        assert 0.4 < time.monotonic() - started < 5
    finally:
        store.released.set()  # this test's thread must not outlive it (the failure it shows, at pytest's exit)
        watch.stop()
    assert exits == ["rank 3 (dp=0, pp=1, tp=1) could not stop its fault watch within 0.5 s (exit_timeout):"
                     " the watch is still in a call to the fault store"], exits
