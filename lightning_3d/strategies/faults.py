"""Strategy hooks that keep a failing or hanging rank from stalling the job (``lightning_3d.faults``)."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from typing_extensions import override

from lightning_3d.faults.watch import FaultWatch


class FaultHandling:
    """Mixed into ``ThreeDStrategy``: starts a ``FaultWatch`` once the process group is up, marks progress at
    every step, publishes an exception raised on this rank, and stops watching at teardown."""

    _fault_watch: Optional[FaultWatch] = None

    def _start_fault_watch(self, hang_timeout: Optional[float], exit_timeout: float) -> None:
        # The default group's key-value store is shared by every rank and outlives any collective; PyTorch has
        # no public accessor for it.
        store = dist.distributed_c10d._get_default_store()
        self._fault_watch = FaultWatch(store, self.global_rank, self.world_size, self._describe_rank,
                                       hang_timeout, exit_timeout)
        self._fault_watch.start()

    def _describe_rank(self, rank: int) -> str:
        c = self.parallel_dims.coords(rank)
        return f"rank {rank} (dp={c.dp}, pp={c.pp}, tp={c.tp})"

    def _progress(self, doing: str) -> None:
        if self._fault_watch is not None:
            self._fault_watch.progress(doing)

    def _stop_fault_watch(self) -> None:
        if self._fault_watch is not None:
            self._fault_watch.stop()
            self._fault_watch = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._fault_watch is not None and not isinstance(exception, KeyboardInterrupt):
            self._fault_watch.announce_failure(exception)
