"""Processes and collectives: how ranks come to be and talk, as Lightning's own parallel strategies do it.

Global ranks, the default process group, and world-wide barrier / broadcast / reduce; ``ThreeDStrategy``'s hooks of those names call these."""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_3d.faults.flight_recorder import enable_flight_recorder, uses_nccl
from lightning_3d.parallel import group_cache
from lightning_3d.pipeline.shared_results import share


WORLD = _group.WORLD


def backend_for(device: torch.device, backend: str) -> str:
    """The default group's backend for ``backend`` on ``device``: NCCL on CUDA gets gloo next to it for host
    tensors ("cuda:nccl,cpu:gloo", as torchtitan does with offload), so a collective on a host tensor -- an
    offloaded gradient and its global norm, anything a library keeps on the host -- is served by gloo instead
    of failing with "No backend type associated with device type cpu" on the first GPU run; device tensors
    still go through NCCL."""
    if device.type == "cuda" and backend == "nccl":
        return "cuda:nccl,cpu:gloo"
    return backend


def init_process_group(cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta,
                       device: torch.device) -> None:
    """The default process group on ``backend``; on NCCL with its Flight Recorder on."""
    # ProcessGroupNCCL reads these variables when it is created, so they are set before.
    enable_flight_recorder(backend)
    device_id = device if device.type != "cpu" else None
    store = restart_store(timeout)
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id,
                          **({"store": store} if store is not None else {}))
    end_process_groups_at_exit()


_ENDS_AT_EXIT: list[bool] = []


def end_process_groups_at_exit() -> None:
    """At the interpreter's exit, while it still runs: destroy every process group, drop the groups and meshes
    made once per process (``parallel/group_cache.py``) and collect what held them. Left to the interpreter's
    finalization, gloo's worker threads outlive the objects they use and a rank can abort after all its work
    is done ("terminate called without an active exception", SIGABRT, which torchrun reports as the job's
    failure), most often in a process that made several meshes and subgroups. Registered once, after Lightning's own exit
    handler (NCCL only), so that it runs first; a no-op where the groups are gone already."""
    if not _ENDS_AT_EXIT:
        _ENDS_AT_EXIT.append(True)
        atexit.register(_end_process_groups)


def _end_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    group_cache.forget()
    gc.collect()


def set_world_ranks(cluster_environment: Optional[ClusterEnvironment], node_rank: int, local_rank: int,
                    num_nodes: int, num_processes: int) -> None:
    """This process's global rank and the world size, as Lightning's parallel strategies set them."""
    if cluster_environment is not None:
        cluster_environment.set_global_rank(node_rank * num_processes + local_rank)
        cluster_environment.set_world_size(num_nodes * num_processes)
    rank = cluster_environment.global_rank() if cluster_environment is not None else 0
    rank_zero_only.rank = utils_rank_zero_only.rank = rank


def barrier(device: torch.device) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if uses_nccl(dist.get_backend()):
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast(obj: TBroadcast, device: torch.device, src: int = 0) -> TBroadcast:
    """``obj`` from global rank ``src``, on every rank; its tensors (Lightning broadcasts scores, too) travel
    as tensors on ``device``, not pickled (``pipeline.shared_results``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    return share(obj, src, group=WORLD, device=device)


def reduce(tensor: Union[Tensor, Any], group: Optional[Any], reduce_op: Optional[Union[ReduceOp, str]]) -> Union[Tensor, Any]:
    """``tensor`` reduced in place over ``group`` (default: the world; anything else returned as it is), as
    Lightning's ``_sync_ddp`` reduces it (``reduce_op`` "mean"/"avg", "sum", "max", "min", a ``ReduceOp``, None
    for sum) less its barrier before the all-reduce, which waits for nothing the all-reduce does not (and on
    NCCL blocks the host): ``self.log(..., sync_dist=True)`` costs one all-reduce per value, none over one rank."""
    if not isinstance(tensor, Tensor) or not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = WORLD if group is None else group
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    if mean:
        on_nccl = tensor.device.type == "cuda" and uses_nccl(dist.get_backend(group))
        op = ReduceOp.AVG if on_nccl else ReduceOp.SUM  # gloo has no AVG
    else:
        op = getattr(ReduceOp, name.upper()) if name else (ReduceOp.SUM if reduce_op is None else reduce_op)
    dist.all_reduce(tensor, op=op, group=group)
    if not mean or op == ReduceOp.AVG:
        return tensor
    return tensor.div_(size) if tensor.is_floating_point() else tensor.copy_(tensor / size)


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
