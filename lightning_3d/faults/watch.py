"""Never hang, never fail silently: a watcher thread on every rank.

Two things stop a multi-rank job from ending by itself: a rank that raised while the others wait in a
collective for it (they wait until the collective timeout, 30 minutes by default), and a rank that waits
forever (a mismatched collective, a stuck data loader). ``FaultWatch`` covers both, through the key-value
store every process group already has:

* **failure**: the rank that raised publishes who it is -- global rank, (dp, pp, tp) coordinates, the
  exception -- under one key (the first failure wins) and writes it to torchrun's error file, so torchrun's
  "root cause" shows it. Every other rank's watcher sees the key within ``poll_s``, prints why it stops
  and ends its process, so the whole job is down within ``exit_timeout_s``.
* **hang**: the strategy calls :meth:`progress` at every step boundary. If none comes for
  ``hang_timeout_s``, the rank prints what it is waiting in (``faults.report``: the collective, the
  pipeline action, its Python stack), tells the other ranks (they print theirs), and the job ends with
  those reports instead of waiting forever.

A watcher ends its process with ``os._exit``: the main thread may be blocked inside a C++ collective that
no Python exception can interrupt. It only does so once a failure or a hang is certain.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Callable

import torch.distributed as dist

from lightning_3d.faults.report import main_thread_report

EXIT_CODE = 17  # a rank stopped because another failed or the job hung (the failing rank exits as Python does)


class FaultWatch:
    def __init__(self, store: dist.Store, rank: int, world_size: int, describe: Callable[[int], str],
                 hang_timeout_s: float | None, exit_timeout_s: float) -> None:
        self.store = dist.PrefixStore("lightning_3d/faults/", store)
        self.rank, self.world_size, self.describe = rank, world_size, describe
        self.hang_timeout_s, self.exit_timeout_s = hang_timeout_s, exit_timeout_s
        self.poll_s = min(0.5, exit_timeout_s / 4)
        self._last_progress = time.monotonic()
        self._doing = "setting up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning_3d-fault-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def progress(self, doing: str) -> None:
        """The rank moved on (called at step boundaries): restart the hang clock."""
        self._last_progress = time.monotonic()
        self._doing = doing

    # ------------------------------------------------------------------ the rank that failed

    def announce_failure(self, exception: BaseException) -> None:
        """On a rank that raised: publish it (unless another rank failed first, or a hang is being reported --
        then this exception is a consequence and the rank just stops), record it for torchrun, and give the
        other ranks' watchers a moment to see it before this process goes away."""
        while exception.__cause__ is not None:  # e.g. the pipeline's RuntimeError around the user's exception
            exception = exception.__cause__
        message = f"{type(exception).__name__}: {exception}"
        payload = json.dumps({"rank": self.rank, "where": self.describe(self.rank), "error": message})
        try:
            hang = self._get("hang")
            winner = hang or self.store.compare_set("failure", "", payload).decode()
        except Exception:  # noqa: BLE001 -- the store is gone (rank 0 ended): nobody left to tell
            return
        if hang:  # the watcher prints this rank's report and ends the process; this error is a consequence
            time.sleep(self.exit_timeout_s)
            self._exit(f"{self.describe(self.rank)} stops: {hang} reported a hang")
        if winner != payload:
            other = json.loads(winner)
            self._exit(f"{self.describe(self.rank)} stops: {other['where']} failed: {other['error']}")
        self.stop()
        _write_torchelastic_error(f"{self.describe(self.rank)} failed: {message}", traceback.format_exc())
        print(f"lightning_3d: {self.describe(self.rank)} failed: {message}", file=sys.stderr, flush=True)
        self._wait_for_acks()

    # ------------------------------------------------------------------ every rank

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                failure, hang = self._get("failure"), self._get("hang")
                stalled = time.monotonic() - self._last_progress
                if failure and json.loads(failure)["rank"] != self.rank:
                    other = json.loads(failure)
                    self.store.add("acks", 1)
                    self._exit(f"{self.describe(self.rank)} stops: {other['where']} failed: {other['error']}")
                timed_out = self.hang_timeout_s is not None and stalled > self.hang_timeout_s
                if hang or timed_out:
                    reporter = hang or self.store.compare_set("hang", "", self.describe(self.rank)).decode()
                    report = (f"{self.describe(self.rank)} made no progress for {stalled:.1f} s (last: {self._doing})"
                              f"{f'; {reporter} reported a hang' if reporter != self.describe(self.rank) else ''}"
                              f"\n{main_thread_report()}")
                    print(f"lightning_3d: {report}", file=sys.stderr, flush=True)
                    if reporter == self.describe(self.rank):
                        self._wait_for_acks()  # the others print what they wait in before this rank's exit
                    else:
                        self.store.add("acks", 1)
                    self._exit(report, printed=True)
            except Exception:  # noqa: BLE001 -- the store is gone: the job is ending; nothing to watch
                return

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _wait_for_acks(self) -> None:
        deadline = time.monotonic() + self.exit_timeout_s / 2
        while time.monotonic() < deadline and self.store.add("acks", 0) < self.world_size - 1:
            time.sleep(self.poll_s / 4)

    def _exit(self, report: str, printed: bool = False) -> None:
        if not printed:
            print(f"lightning_3d: {report}", file=sys.stderr, flush=True)
        # torchrun names the earliest failure as the root cause; ranks stopped here may tie with the one
        # that failed, so their error files say what really happened.
        _write_torchelastic_error(report, report)
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _write_torchelastic_error(message: str, details: str) -> None:
    """torchrun's error file (``TORCHELASTIC_ERROR_FILE``), in its format, so its summary names our failure."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": details, "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)
