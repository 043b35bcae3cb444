"""Never hang, never fail silently: a watcher thread on every rank.

Two things stop a multi-rank job from ending by itself: a rank that raised while the others wait in a
collective for it (they would wait until the collective timeout, 30 minutes by default), and a rank that
waits forever (a mismatched collective, a stuck data loader). ``FaultWatch`` covers both, through the
key-value store every process group already has:

* **failure**: a rank that raises publishes who it is -- global rank, (dp, pp, tp) coordinates, the
  original exception -- under one key (the first failure wins) and writes it to torchrun's error file, so
  torchrun's "root cause" shows it. Every other rank's watcher sees the key within ``poll_s``. A rank that
  raises too within ``exit_timeout_s / 2`` (an error every rank meets, e.g. a bad config found at setup)
  goes its own way, and the user may catch that exception; a rank that does not -- it is blocked in a
  collective waiting for the failed one -- prints why it stops and ends its process. So the whole job is
  down within ``exit_timeout_s``.
* **hang**: the watch times phases (:class:`Phase`): set-up, a checkpoint's load or save, skipping to a
  resume point, and the steps (training, validation, ...), each with its own limit, since building or
  loading a large model legitimately takes far longer than a step. The strategy calls :meth:`enter` when
  a phase begins and at every step boundary (each restarts the clock). If the current phase makes no
  progress within its limit, the rank prints the phase and what it is waiting in (``faults.report``: the
  collective, the pipeline action, its Python stack), tells the other ranks (they print theirs), and the
  job ends with those reports instead of waiting forever. On NCCL each rank first asks NCCL's Flight
  Recorder to dump its last collectives and names the file (``faults.flight_recorder``): there the Python
  stack shows the next point that waits for the GPU, not the collective that hangs.

The store is read over the network; if reading it fails, the rank says so on stderr (it would not hear of
another rank's failure meanwhile), keeps trying at every poll, and says so again when it can read it.

A watcher ends its process with ``os._exit``: the main thread may be blocked inside a C++ collective that
no Python exception can interrupt. Keys live under a generation number (one per ``fit``/``validate``/...
call, counted alike on every rank), so a failure caught by the user does not haunt the next call.

:meth:`FaultWatch.stop` joins the watcher before it returns (and the interpreter's exit stops a watch left
running). A daemon thread still inside a call into torch's store when the interpreter finalizes is ended
by CPython with ``pthread_exit``, whose unwinding through pybind11's GIL guard (a ``noexcept`` destructor)
aborts the process: "terminate called without an active exception", SIGABRT, after all the work was done.
A watcher that does not end within ``exit_timeout_s`` is reported by name, and its rank exits with
``EXIT_CODE`` instead.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from lightning_3d.faults.flight_recorder import FlightRecorder
from lightning_3d.faults.report import main_thread_report

EXIT_CODE = 17  # a rank stopped because another failed or the job hung (the failing rank exits as Python does)
_GENERATIONS = itertools.count()


@dataclass(frozen=True)
class Phase:
    """What a rank is doing, for how long it may go without progress, and which setting says so."""

    name: str
    """Named in the hang report: "set-up", "checkpoint save", "training", ..."""
    timeout_s: Optional[float]
    """Seconds without progress before the rank is reported as hung; None: no limit in this phase."""
    setting: str = ""
    """The strategy argument that sets ``timeout_s`` (the report names it, so the user knows what to change)."""

    def describe(self, last: str) -> str:
        limit = "no limit" if self.timeout_s is None else f"{self.timeout_s:g} s"
        return f'phase "{self.name}" ({self.setting or "limit"}: {limit}; last: {last})'


class FaultWatch:
    def __init__(self, store: dist.Store, rank: int, world_size: int, describe: Callable[[int], str],
                 phase: Phase, exit_timeout_s: float, flight_recorder: Optional[FlightRecorder] = None) -> None:
        self.store = dist.PrefixStore(f"lightning_3d/faults/{next(_GENERATIONS)}/", store)
        self.rank, self.world_size, self.describe = rank, world_size, describe
        self.flight_recorder = flight_recorder  # NCCL's, or None (other backends have none)
        self.exit_timeout_s = exit_timeout_s
        self.poll_s = min(0.5, exit_timeout_s / 8)
        # (phase, what it did last, when its clock started): one tuple, replaced whole, so that the watcher
        # thread never pairs a new phase's limit with the old phase's clock.
        self._where = (phase, "starting", time.monotonic())
        self._raised = threading.Event()  # this rank's own exception is on its way: never kill it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning_3d-fault-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.stop)  # a run that never reached the strategy's teardown

    def stop(self) -> None:
        """End the watcher and wait for it (at most ``exit_timeout_s``): once this returns, this rank runs no
        thread of the watch. One that is still running then (stuck in a call to the store) is reported by name,
        and the rank exits with ``EXIT_CODE`` rather than abort at the interpreter's exit (module docstring)."""
        self._stop.set()
        atexit.unregister(self.stop)
        if not self._thread.is_alive() or self._thread is threading.current_thread():
            return
        self._thread.join(self.exit_timeout_s)
        if self._thread.is_alive():
            self._exit(f"{self.describe(self.rank)} could not stop its fault watch within {self.exit_timeout_s:g} s"
                       " (exit_timeout): the watch is still in a call to the fault store")

    @property
    def phase(self) -> Phase:
        return self._where[0]

    def enter(self, phase: Phase, doing: str = "started") -> None:
        """The rank begins ``phase``, or moves on within it (``doing``): the clock restarts, under its limit."""
        self._where = (phase, doing, time.monotonic())

    @contextmanager
    def entered(self, phase: Phase) -> Iterator[None]:
        """``phase`` for the duration of the block; then the phase around it again, its clock afresh."""
        around = self.phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(around, f"{phase.name} done")

    # ------------------------------------------------------------------ a rank that raised

    def announce_failure(self, exception: BaseException) -> None:
        """Publish this rank's exception unless another rank's came first; if it is the first, record it for
        torchrun and give the other ranks' watchers a moment to see it before this process goes away."""
        self._raised.set()
        self._stop.set()  # joined at the strategy's teardown, which follows
        while exception.__cause__ is not None:  # e.g. the pipeline's RuntimeError around the user's exception
            exception = exception.__cause__
        message = f"{type(exception).__name__}: {exception}"
        payload = json.dumps({"rank": self.rank, "where": self.describe(self.rank), "error": message})
        try:
            if self._get("hang"):
                return  # a consequence of a hang being reported (a peer's exit broke a collective)
            first = self.store.compare_set("failure", "", payload).decode() == payload
            if not first:
                self.store.add("acks", 1)
                return
        except Exception as error:  # noqa: BLE001 -- the store is gone (the rank hosting it ended)
            self._say(f"could not tell the other ranks of its failure ({type(error).__name__}: {error}): they"
                      " learn of it only when a collective or their hang watchdog times out")
            return
        _write_torchelastic_error(f"{self.describe(self.rank)} failed: {message}")
        print(f"lightning_3d: {self.describe(self.rank)} failed: {message}", file=sys.stderr, flush=True)
        self._wait_for_acks(self.world_size - 1)

    # ------------------------------------------------------------------ every rank

    def _watch(self) -> None:
        store_error, failure_seen_at = None, None
        while not self._stop.wait(self.poll_s):
            failure = hang = None
            try:
                failure, hang = self._get("failure"), self._get("hang")
            except Exception as error:  # noqa: BLE001 -- a network store fails in many ways; retried next poll
                if store_error is None:  # once per outage: a report every poll would drown the log
                    self._say(f"cannot read the fault store ({type(error).__name__}: {error}): until it can, this"
                              " rank does not hear of failures or hangs on other ranks; retrying every"
                              f" {self.poll_s:g} s")
                store_error = error
            else:
                if store_error is not None:
                    self._say("reads the fault store again: failures and hangs on other ranks reach it again")
                    store_error = None
            if failure and json.loads(failure)["rank"] != self.rank:
                other = json.loads(failure)
                report = f"{self.describe(self.rank)} stops: {other['where']} failed: {other['error']}"
                if failure_seen_at is None:  # say it now: a launcher may end this process before the grace ends
                    failure_seen_at = time.monotonic()
                    print(f"lightning_3d: {report}", file=sys.stderr, flush=True)
                    self._ack()
                if time.monotonic() - failure_seen_at > self.exit_timeout_s / 2 and not self._raised.is_set():
                    self._exit(report, printed=True)
            phase, doing, since = self._where
            stalled = time.monotonic() - since
            if hang or (phase.timeout_s is not None and stalled > phase.timeout_s):
                self._report_hang(hang, stalled, phase, doing, store_ok=store_error is None)

    def _report_hang(self, reported_by: str | None, stalled: float, phase: Phase, doing: str, store_ok: bool) -> None:
        me = self.describe(self.rank)
        if reported_by is None and store_ok:
            try:
                reported_by = self.store.compare_set("hang", "", me).decode()
            except Exception:  # noqa: BLE001
                pass
        also = f"; {reported_by} reported a hang" if reported_by and reported_by != me else ""
        stopped = f"{me} made no progress for {stalled:.1f} s in {phase.describe(doing)}{also}"
        asked_at, not_asked = time.time(), None
        if self.flight_recorder is not None:  # asked first: NCCL dumps on its own thread while the stack prints
            not_asked = self.flight_recorder.request_dump()
        print_by_line(f"lightning_3d: {stopped}\n{main_thread_report()}")
        if self.flight_recorder is not None:
            print_by_line(self.flight_recorder.report(asked_at, not_asked))
        # No rank goes away before every rank has printed what it waits in: torchrun ends the other ranks as
        # soon as one exits, and a rank slow to notice the hang (a loaded host) would end without its report.
        self._ack()
        self._wait_for_acks(self.world_size)
        self._exit(stopped, printed=True)

    def _say(self, message: str) -> None:
        print(f"lightning_3d: {self.describe(self.rank)} {message}", file=sys.stderr, flush=True)

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _ack(self) -> None:
        try:
            self.store.add("acks", 1)
        except Exception:  # noqa: BLE001 -- the store is gone
            pass

    def _wait_for_acks(self, count: int) -> None:
        # The whole exit timeout: each rank prints its stacks first, which takes seconds on a loaded host.
        deadline = time.monotonic() + self.exit_timeout_s
        try:
            while time.monotonic() < deadline and self.store.add("acks", 0) < count:
                time.sleep(self.poll_s / 4)
        except Exception:  # noqa: BLE001 -- the store is gone
            pass

    def _exit(self, report: str, printed: bool = False) -> None:
        if not printed:
            print(f"lightning_3d: {report}", file=sys.stderr, flush=True)
        # torchrun names the earliest failure as the root cause; ranks stopped here may tie with the one
        # that failed, so their error files say what really happened.
        _write_torchelastic_error(report)
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _write_torchelastic_error(message: str) -> None:
    """torchrun's error file (``TORCHELASTIC_ERROR_FILE``), in its format, so its summary names our failure."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    details = traceback.format_exc() if sys.exc_info()[0] is not None else message
    data = {"message": {"message": message, "extraInfo": {"py_callstack": details, "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)


def print_by_line(text: str) -> None:
    """``text`` on stderr, one write per line. The ranks of a job share one stderr; a write longer than a pipe
    writes at once (4 KiB) may be cut anywhere, and another rank's report then began inside one of this rank's
    lines, where neither a reader nor a pattern anchored at the line's start finds it. A line written alone
    arrives whole, between whole lines."""
    for line in text.splitlines():
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
