"""Processes and collectives: how ranks come to be and talk, as Lightning's own parallel strategies do it."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_3d.faults.flight_recorder import enable_flight_recorder
from lightning_3d.parallel.dims import ParallelDims


class ProcessesAndCollectives:
    """Strategy hooks (mixed into ``ThreeDStrategy``): the launcher (``devices=N`` starts the processes
    unless torchrun or Slurm did), global ranks, and world-wide barrier / broadcast / reduce."""

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            # About to start num_nodes * devices processes: a layout that cannot be cut from them fails here,
            # at Trainer(...), in seconds, instead of in every process started (minutes for 64 of them).
            # Under torchrun / srun the processes exist already; each checks in setup_environment.
            ParallelDims.from_config(self.parallel_config, self.num_nodes * self.num_processes)
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _init_process_group(self) -> None:
        """The default process group on ``self._process_group_backend``; on NCCL with its Flight Recorder on."""
        # ProcessGroupNCCL reads these variables when it is created, so they are set before.
        enable_flight_recorder(self._process_group_backend)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        store = restart_store(self._timeout)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id, **({"store": store} if store is not None else {}))

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        objects = [obj]
        torch.distributed.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        # Lightning syncs logged values (sync_dist=True) here. Every tensor- and pipeline-parallel rank of a
        # replica logs the same value (the pipeline engine replays the last stage's), so the default group is
        # the data-parallel one: over every rank, reduce_fx="sum" would count a value tp * pp times.
        if group is None and self._device_mesh is not None:
            group = self._device_mesh["dp"].get_group()
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Over every rank (ModelCheckpoint, EarlyStopping): not the data-parallel default of reduce().
        count = self.reduce(torch.tensor(int(decision), device=self.root_device), group=_group.WORLD,
                            reduce_op=ReduceOp.SUM)
        return bool(count == self.world_size) if all else bool(count)


def restart_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun, after a restart: the agent's store, seen under a prefix of this attempt; else None.

    torchrun (PyTorch 2.13, ``--standalone``) keeps its key-value store across the restarts of a job, and the
    process group of a restarted attempt would read the addresses the dead attempt's ranks published there:
    gloo then fails with "connectFullMesh failed ... Connection refused". Each attempt gets keys of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"lightning_3d/attempt_{attempt}", store)
