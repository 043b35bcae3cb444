"""Lightning's SIGTERM check before every training batch, made on the host and one batch ahead.

Lightning 2.6 makes the ranks agree before each training batch on whether rank 0 has received SIGTERM: a
broadcast of a flag on the root device from rank 0, then ``.item()`` (``_TrainingEpochLoop``'s
``_broadcast_sigterm_tensor``). On a GPU that is an NCCL broadcast and a copy to the host: a host sync per
step, which keeps the host from queueing the next step's kernels while the GPU still runs this one (Lightning
issue #21487). On any device it is a blocking collective of the whole world per step. Its SIGTERM handler
also broadcasts, from inside the handler, on the default group: a collective that the other ranks match only
by chance, where the signal reaches them at other points of the step.

:class:`StopSignal` takes the place of both for the fit:

* the handler only records the signal (and, as Lightning's does, passes it on to the processes Lightning's
  launcher started), with no collective;
* before each batch, the ranks' flags are combined by an all-reduce (max) of a one-byte host tensor over a gloo
  group of their own: posted before batch k, without waiting, and read before batch k + 1, when it has had a
  whole step to arrive. No device is involved, and in steady state no rank waits.

Every rank reads the all-reduce of the same batch, so all of them stop together, with Lightning's
``SIGTERMException``, one batch later than Lightning would: a SIGTERM that any rank has received before batch k
stops the run before batch k + 1. (Lightning listened to rank 0's signal only.)

The group is made at the start of each fit and destroyed at its end, once the last all-reduce has arrived. A
fit that fails may leave one posted; that group is left alone, and the next fit makes a new one, which the
posted all-reduce can never be mistaken for.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info


class StopSignal:
    """Whether any rank has received SIGTERM, agreed by every rank one training batch ahead (see the module
    docstring).

    Example::

        stop = StopSignal.install(trainer)   # on_train_start, on every rank
        ...                                  # Lightning calls stop.check() before each batch
        stop.close()                         # on_train_end, on every rank
    """

    def __init__(self, trainer: Any, group: dist.ProcessGroup) -> None:
        self._trainer, self._group = trainer, group
        self._flag = torch.zeros(1, dtype=torch.uint8)  # host memory whatever the device: gloo, no device sync
        self._posted: dist.Work | None = None
        self._received = False  # this rank's SIGTERM, until the ranks agree on it
        self._lightnings_handler: Any = None  # Lightning's SIGTERM notifier, while this one stands in for it

    @classmethod
    def install(cls, trainer: Any) -> StopSignal | None:
        """Stand in for the trainer's per-batch SIGTERM broadcast and its SIGTERM handler's. Collective (it makes
        the group): every rank calls it at the start of the fit. None, and nothing replaced, on one process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        stop = cls(trainer, dist.new_group(backend="gloo"))
        stop._take_over()
        return stop

    def _take_over(self) -> None:
        self._trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self.check
        notifier = self._trainer._signal_connector._sigterm_notifier_fn
        self._lightnings_handler = notifier if self._swap_handler(notifier, self._notice) else None

    def check(self) -> None:
        """Before a training batch: stop if any rank had received SIGTERM before the previous one; then post
        this rank's flag as it is now, for the next batch."""
        if self._posted is not None:
            self._posted.wait()
            self._posted = None
            if self._flag.numpy()[0]:  # a host tensor: reading it syncs nothing
                self._trainer._signal_connector.received_sigterm = True  # what on_exception callbacks read
                with contextlib.suppress(Exception):
                    dist.barrier(group=self._group)  # as Lightning does: every rank stops here before any exits
                raise SIGTERMException()
        self._flag.fill_(int(self._received))
        self._posted = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def close(self) -> None:
        """At the end of the fit, on every rank: give Lightning its check and handler back, wait for the last
        posted all-reduce, then destroy the group."""
        self._trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        if self._lightnings_handler is not None:
            self._swap_handler(self._notice, self._lightnings_handler)
        if self._posted is not None:
            self._posted.wait()
            self._posted = None
        dist.destroy_process_group(self._group)

    def _notice(self, signum: int, _frame: Any) -> None:
        """The SIGTERM handler: Lightning's, less its broadcast, and with the flag kept apart until the ranks
        agree. Lightning's flag (``trainer.received_sigterm``) would stop this rank alone at the end of its
        batch (Lightning checks it there, rank by rank), while the others go on to the next and wait for it."""
        rank_zero_info(rank_prefixed_message(f"Received SIGTERM: {signum}", self._trainer.local_rank))
        launcher = self._trainer.strategy.launcher
        if not self._received and launcher is not None:
            launcher.kill(signum)  # the processes Lightning's own launcher started
        self._received = True

    @staticmethod
    def _swap_handler(old: Any, new: Any) -> bool:
        """Put ``new`` where ``old`` is among the handlers Lightning composed for SIGTERM (with Slurm's and any
        the user had), if it is there and this is the main thread (where signal handlers are set). Whether it
        was."""
        if threading.current_thread() is not threading.main_thread():
            return False
        handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
        if not (isinstance(handlers, list) and old in handlers):
            return False
        handlers[handlers.index(old)] = new
        return True
