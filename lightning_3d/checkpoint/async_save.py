"""Asynchronous checkpoints: DCP's ``async_save`` writes the shards while training goes on.

A save does, in order (``AsyncSaves.save``):

1. wait for the previous save, if it is still in flight: at most one is, so host memory holds at most one
   staged copy of the state, and two saves never share the background process group (the wait is logged);
2. in the training thread: the temporary directory (``atomic.start``), this rank's random streams and rank 0's
   Lightning state (small, pickled now, from host copies), then ``dcp.async_save``, which *stages* the
   state -- copies every tensor into host memory -- before it returns, so the optimizer step that follows
   cannot change what is written. The host buffers are allocated at the first save and reused by the next
   ones (DCP's ``DefaultStager`` keeps them per tensor storage): a save after the first only copies. That
   reuse is safe only because the previous save has finished writing from them -- step 1;
3. in DCP's background thread: the shards, planned and written over a gloo process group of their own (the
   training thread keeps the default group; on CUDA that is NCCL, which must not be driven from a second
   thread, and DCP's planning collectives exchange pickled plans on the host);
4. the completion step, in a background thread too: once rank 0's DCP save returns, every rank's shards
   are on disk (DCP gathers each rank's write results on rank 0 before it returns), so rank 0 commits the
   directory (``atomic.commit``). A rank killed before that leaves ``.NAME.partial`` and the previous
   checkpoint whole.

Removing an old checkpoint (``ModelCheckpoint(save_top_k=...)``) is queued after the pending commit: the
checkpoint it replaces stays until the new one is complete.

A second save of the step being written -- ``ModelCheckpoint(save_last=True)`` saves ``last.ckpt`` right after
the step's top-k checkpoint -- holds the same weights and optimizer state (they change only in an optimizer
step, which moves the step on). It does not wait for the first or stage and write them again: it writes its
own small files now, and its completion step, after the first's, links the first's shard files into it
(hard links; copies where the filesystem has none) and commits it (``AsyncSaves._save_again``).
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_3d.checkpoint import atomic, sharded
from lightning_3d.checkpoint.boxes import BoxesSavePlanner
from lightning_3d.errors import CheckpointError
from lightning_3d.fused_parts import FusedParts


class AsyncSaves:
    """Sharded checkpoint saves that return once the state is staged on the host; one in flight at a time.

    Example (what ``ShardedCheckpoints`` does with ``ThreeDStrategy(async_checkpoint=True)``)::

        saves = AsyncSaves()
        saves.save(path, state, meta, rank_state)  # collective; returns before the shards are written
        ...                                         # training goes on
        saves.wait("loading a checkpoint")          # the save is committed (rank 0) once this returns
        saves.close()                               # at the end of fit: wait, then release the process group
    """

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None  # gloo, for DCP's background collectives
        # One thread, so commits and removals run in the order they were asked for, each after the last.
        self._completion: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None  # the last completion step or removal queued
        self._pending_path: Optional[Path] = None
        self._pending_step: Optional[int] = None  # the global step whose state the pending save holds
        self._pending_source: Optional[Path] = None  # where that state's shards are written (the first save's)
        self._stager: Optional[DefaultStager] = None  # the host copy of the state, kept between saves

    def save(self, path: Path, state: dict[str, Any], meta: dict[str, Any], rank_state: dict[str, Any],
             layouts: dict[str, FusedParts] | None = None) -> None:
        """Start writing ``state`` (DCP), ``meta`` (rank 0) and ``rank_state`` (every rank) to ``path``
        (``layouts`` as for ``sharded.save``); the directory appears, whole, once every rank has written.
        Collective over the default process group."""
        step = meta.get("global_step")
        if self._pending is not None and step is not None and step == self._pending_step:
            self._save_again(path, meta, rank_state)
            return
        self.wait(f"saving {path}")
        group = self._process_group()
        partial = sharded.begin(path)
        sharded.write_small_files(partial, meta, rank_state)
        written = dcp.async_save(state, storage_writer=sharded.writer(partial), planner=BoxesSavePlanner(layouts),
                                 process_group=group, async_stager=self._host_copy())
        self._pending = self._executor().submit(_complete, written, path, dist.get_rank() == 0)
        self._pending_path, self._pending_step, self._pending_source = path, step, path

    def _save_again(self, path: Path, meta: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """A save of the step whose state is being written (module doc): its small files now, its shards linked
        from the first save's once that is committed, then committed itself; training does not wait."""
        partial = sharded.begin(path)
        sharded.write_small_files(partial, meta, rank_state)
        dist.barrier()  # every rank's small files are on disk before rank 0 can commit
        previous, source = self._pending, self._pending_source
        self._pending = self._executor().submit(_complete_linked, previous, source, path, dist.get_rank() == 0)
        self._pending_path = path

    def after_pending(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the pending save is committed (now if none is pending), off the training thread;
        never if that save failed (its error is raised at the next wait instead)."""
        previous = self._pending
        if previous is None:
            work()
            return
        self._pending = self._executor().submit(lambda: (previous.result(), work()))

    def wait(self, before: str) -> None:
        """Block until the pending save is written and committed; raise if it failed. Logs the seconds waited
        when a save was still in flight (``before``: what waits, for the log)."""
        pending, path = self._pending, self._pending_path
        if pending is None:
            return
        in_flight, started = not pending.done(), time.perf_counter()
        self._pending = None
        try:
            pending.result()
        except Exception as err:
            raise CheckpointError(f"The asynchronous save of {path} failed: {type(err).__name__}: {err}. It was"
                                  " never committed; the previous checkpoint is whole.") from err
        if in_flight:
            rank_zero_info(f"lightning_3d: waited {time.perf_counter() - started:.2f} s for the asynchronous save"
                           f" of {path} to finish before {before} (at most one save is in flight)")

    def close(self, failed: bool = False) -> None:
        """At the end of a run: wait for the pending save and release the background process group. With
        ``failed`` (the run is ending on an error) a save that cannot finish is reported, not raised."""
        try:
            self.wait("the end of the run")
        except CheckpointError as err:
            if not failed:
                raise
            rank_zero_warn(f"lightning_3d: {err}")
        finally:
            if self._completion is not None:
                self._completion.shutdown(wait=not failed)
                self._completion = None
        if self._stager is not None:
            self._stager.close()  # frees the host copy
            self._stager = None
        if self._group is not None and not failed:
            dist.barrier(group=self._group)  # no rank still receives on it (DCP's last broadcast)
            dist.destroy_process_group(self._group)
        self._group = None

    def _host_copy(self) -> DefaultStager:
        """Stages synchronously: the copy is done when ``async_save`` returns, before any optimizer step (an
        asynchronous copy would race with it). Pinned host memory on CUDA, for the device-to-host copy."""
        if self._stager is None:
            options = StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                     use_async_staging=False, use_non_blocking_copy=False)
            self._stager = DefaultStager(options)
        return self._stager

    def _process_group(self) -> dist.ProcessGroup:
        """A gloo group over every rank, made (collectively) at the first save: DCP's planning and its
        final gather run on it from the background thread, never on the training thread's default group."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _executor(self) -> ThreadPoolExecutor:
        if self._completion is None:
            self._completion = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_3d-checkpoint")
        return self._completion


def _complete_linked(previous: Future, source: Path, path: Path, commits: bool) -> None:
    """The completion step of a second save of a step: once the first is committed (rank 0; elsewhere: once
    this rank's write is done), rank 0 links the first's shard files into this one and commits it."""
    previous.result()
    if not commits:
        return
    partial = atomic.partial_path(path)
    for item in source.iterdir():
        if item.name in (sharded.META_FILE, sharded.RNG_DIR):
            continue  # this save's own, written already
        _link_or_copy(item, partial / item.name)
    atomic.commit(path)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (the bytes are on disk already), or where the filesystem has none a copy, synced."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
        with open(target, "rb") as copied:
            os.fsync(copied.fileno())


def _complete(written: Future, path: Path, commits: bool) -> None:
    """The completion step: wait for this rank's DCP write; rank 0 then commits. When rank 0's DCP save
    returns, every rank's shards and small files are on disk (DCP's write step ends with a gather of every
    rank's results on rank 0, and the small files were written before it began)."""
    written.result()
    if commits:
        atomic.commit(path)
