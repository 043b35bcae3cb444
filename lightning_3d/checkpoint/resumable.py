"""Resume mid-epoch from the next batch, not from the start of the epoch.

Lightning restores the loops' counters from a checkpoint, but a plain ``DataLoader`` restarts its epoch from
the first batch, so a run resumed mid-epoch would train on batches it already saw. Lightning saves and
restores the state of a training loader that has ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader`` is one: the strategy leaves those alone); ``ResumableLoader`` gives any other loader
those: its state is the number of batches of the current epoch already trained on, and after a restore its
next iteration starts that many batches later.

How it starts later: a ``DataLoader`` that batches its sampler's indices with torch's ``BatchSampler`` (what
the strategy's ``DistributedSampler`` gets) starts its sampler's index list at ``batches * batch_size``, so
the skipped samples are never read. Other loaders (an ``IterableDataset``, a custom ``batch_sampler``) draw
the skipped batches and drop them, which costs reading them. Either way the sampler's epoch is set to the
resumed epoch first: Lightning sets it only after it has drawn the epoch's first batch, and the shuffle of
epoch 0 would otherwise be resumed.
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable, Iterator, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler


class ResumableLoader:
    """Wraps ``loader``; ``batches_done()`` says how many batches of the current epoch have been trained on
    (the strategy reads it from the trainer's progress, which unlike a count of fetched batches does not
    include the batch Lightning prefetches) and ``epoch()`` which epoch that is. A skip that draws batches
    runs inside ``skipping()`` (the strategy times it as a phase of its own: reading many batches may take
    long)."""

    def __init__(self, loader: Iterable, batches_done: Callable[[], int], epoch: Callable[[], int] = lambda: 0,
                 skipping: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.loader = loader
        self._batches_done = batches_done
        self._epoch = epoch
        self._skipping = skipping
        self._skip = 0

    def __iter__(self) -> Iterator:
        skip, self._skip = self._skip, 0
        if not skip:
            return iter(self.loader)
        _set_epoch(self.loader, self._epoch())
        batch_sampler = _index_batch_sampler(self.loader)
        if batch_sampler is not None:
            batch_sampler.sampler = _StartAt(batch_sampler, skip * batch_sampler.batch_size)
            return iter(self.loader)
        rank_zero_info(f"lightning_3d: resuming at batch {skip} of the epoch reads and drops the {skip} batches"
                       f" before it: the training loader ({type(self.loader).__name__}) cannot start its sampler"
                       " later (an IterableDataset, a custom batch_sampler, or batch_size=None). A map-style"
                       " dataset batched by batch_size, or torchdata's StatefulDataLoader, resumes without reading.")
        iterator = iter(self.loader)
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


class _StartAt(Sampler):
    """Stands in for ``batch_sampler.sampler`` for one iteration: the same indices from ``start`` on. Its
    iteration puts the sampler back, so the epochs after the resumed one see the loader as it was."""

    def __init__(self, batch_sampler: BatchSampler, start: int) -> None:
        self.batch_sampler, self.sampler, self.start = batch_sampler, batch_sampler.sampler, start

    def __iter__(self) -> Iterator[int]:
        self.batch_sampler.sampler = self.sampler
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return len(self.sampler)  # the whole epoch, as Lightning counts it (batch_idx goes on from the resume)

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it on batch_sampler.sampler too
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _index_batch_sampler(loader: Iterable) -> Optional[BatchSampler]:
    """``loader``'s batch sampler if it cuts its sampler's indices into consecutive batches of ``batch_size``
    (then skipping indices skips exactly those batches), else None."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batch_sampler = loader.batch_sampler  # None with batch_size=None; a subclass may batch otherwise
    return batch_sampler if type(batch_sampler) is BatchSampler else None


def _set_epoch(loader: Iterable, epoch: int) -> None:
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for sampler in {id(s): s for s in samplers if hasattr(s, "set_epoch")}.values():
        sampler.set_epoch(epoch)
