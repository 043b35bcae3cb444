"""Where the engine's last step went, in wall-clock seconds per part: read by ``benchmarks/profile_pipeline.py``.

The engine times its parts with :meth:`StepCosts.part`, nested as they run: the schedule inside the step, the
loss function's wrapper inside the schedule, the user's loss code inside that. Each part keeps only its own
time (an inner part's is taken out of the outer one), so the parts add up to the time spent in the engine.
Two ``perf_counter`` calls per part, a few dozen per step: no device sync, nothing to switch on.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class StepCosts:
    """Seconds per part of the last step (``seconds``), each part without the parts timed inside it.

    Example::

        costs = StepCosts()
        with costs.step():                 # clears the last step's; its own code counts as "bookkeeping"
            with costs.part("schedule"):
                with costs.part("user_loss"):
                    ...                    # counted in "user_loss" only
        costs.seconds                      # {"bookkeeping": ..., "schedule": ..., "user_loss": ...}
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []  # the parts running now, innermost last
        self._since = 0.0  # when the innermost part last started or resumed

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step of the engine; a step inside a step (``run`` called by ``training_step``) is the same one."""
        if not self._open:
            self.seconds = {}
        with self.part("bookkeeping"):
            yield

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        self._charge()
        self._open.append(name)
        try:
            yield
        finally:
            self._charge()
            self._open.pop()

    def _charge(self) -> None:
        """The time since ``_since`` goes to the innermost open part."""
        now = time.perf_counter()
        if self._open:
            name = self._open[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._since
        self._since = now
