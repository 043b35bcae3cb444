"""Intra-op threads per rank: ranks that share one host's CPUs split them, unless the user chose a count.

Each process's torch starts with one intra-op thread per CPU it may run on. Eight ranks on a 2-core machine
then run 16 busy threads on 2 cores, and each step takes several times as long as with one thread each.
torchrun (PyTorch 2.13) sets ``OMP_NUM_THREADS=1`` for its workers when it is unset and it starts more than
one per node; Lightning's own launcher sets ``cpus // processes`` in the process that launches, but only
there when the strategy starts no launcher in the others (ours starts none in processes that already exist,
so its rank 1..n-1 kept torch's default). This module gives every rank the same rule.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

# What the user chose, read when lightning_3d is imported: before Lightning's launcher sets
# OMP_NUM_THREADS in the process that launches (to the same count this module picks), and before
# anything of ours runs. A torch.set_num_threads() call after this import changes the count from this one.
_OMP_AT_IMPORT = os.environ.get("OMP_NUM_THREADS")
_THREADS_AT_IMPORT = torch.get_num_threads()


def is_thread_count(value: Optional[str]) -> bool:
    """Whether OMP_NUM_THREADS holds a thread count. torch (its OpenMP) ignores any other value, an empty one
    included, and runs one thread per CPU; torchrun leaves a variable that is set alone, empty or not. An empty
    one is what ``export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK`` gives where ``--cpus-per-task`` was not given."""
    return value is not None and value.strip().isdigit() and int(value) > 0


def threads_per_rank(local_ranks: int) -> int:
    """``max(1, CPUs this process may run on // ranks on this host)``, Lightning's count (torchrun picks 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


def local_world_size(devices: int) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else the devices per node Lightning was given (its
    launcher starts that many here; under Slurm, devices must equal the tasks per node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", devices))


def set_threads_per_rank(devices: int) -> Optional[int]:
    """Give this rank its share of the host's CPUs, unless the user set a count (``OMP_NUM_THREADS``, also
    torchrun's, or ``torch.set_num_threads`` after importing lightning_3d); an OMP_NUM_THREADS that is not a
    count (empty, 0) sets none. Returns the count it set, or None."""
    local_ranks = local_world_size(devices)
    threads = threads_per_rank(local_ranks)
    current = torch.get_num_threads()
    # Changed since import to another count than ours: the user's call (Lightning's launcher picks ours).
    chosen_by_user = is_thread_count(_OMP_AT_IMPORT) or current not in (_THREADS_AT_IMPORT, threads)
    if chosen_by_user:
        return None
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # processes this rank starts (data loader workers) follow it
    ignored = f" (OMP_NUM_THREADS={_OMP_AT_IMPORT!r} is not a count)" if _OMP_AT_IMPORT is not None else ""
    rank_zero_info(f"lightning_3d: {threads} intra-op thread(s) per rank ({len(os.sched_getaffinity(0))} CPUs"
                   f" // {local_ranks} ranks on this host){ignored}; set OMP_NUM_THREADS to choose another count")
    return threads
