"""Resume mid-epoch from the next batch, not from the start of the epoch.

Lightning restores the loops' counters from a checkpoint, but a plain ``DataLoader`` restarts its epoch from
the first batch, so a run resumed mid-epoch would train on batches it already saw. Lightning saves and
restores the state of a training loader that has ``state_dict``/``load_state_dict``; ``ResumableLoader``
gives any loader those: its state is the number of batches of the current epoch already trained on, and
after a restore its next iteration skips that many. The sampler's epoch (hence the shuffle order) is set by
Lightning as usual, so the skipped batches are exactly the ones trained on before.

Skipping draws the batches and drops them: it costs reading them (not computing on them).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable, Iterator


class ResumableLoader:
    """Wraps ``loader``; ``batches_done()`` says how many batches of the current epoch have been trained on
    (the strategy reads it from the trainer's progress, which unlike a count of fetched batches does not
    include the batch Lightning prefetches). The skip runs inside ``skipping()`` (the strategy times it as a
    phase of its own: reading many batches may take long)."""

    def __init__(self, loader: Iterable, batches_done: Callable[[], int],
                 skipping: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.loader = loader
        self._batches_done = batches_done
        self._skipping = skipping
        self._skip = 0

    def __iter__(self) -> Iterator:
        iterator = iter(self.loader)
        skip, self._skip = self._skip, 0
        if skip:
            with self._skipping():
                for _ in range(skip):
                    next(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # sampler, batch_sampler, dataset, batch_size...: Lightning reads these from the loader it was given.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def state_dict(self) -> dict[str, int]:
        return {"batches_done": self._batches_done()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["batches_done"]
