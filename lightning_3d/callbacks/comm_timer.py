"""CommTimer: bytes and time of communication per parallel dimension (tp, pp, dp) per training step."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist

from lightning_3d.callbacks.layout import dims_of
from lightning_3d.callbacks.comm_recorder import CommRecorder, clock_for, union_seconds

DIMS = ("tp", "pp", "dp", "other")
HSDP_DIMS = ("dp_shard", "dp_replicate")
"""Under HSDP, ZeRO's collectives run on these groups (reduce-scatter and all-gather within a shard group, the
all-reduce across replicas); "dp" then keeps what runs on the whole dp group (e.g. a logged value's mean)."""


class CommTimer(L.Callback):
    """Logs, every ``every_n_steps`` training batches (default: the Trainer's ``log_every_n_steps``), for each
    parallel dimension ``d`` in ``tp``, ``pp``, ``dp`` (under HSDP also ``dp_shard`` and ``dp_replicate``, see
    ``HSDP_DIMS``), and ``other`` (groups outside the mesh, e.g. the whole world for other callbacks'
    all-gathers):

    * ``comm/{d}_bytes`` -- bytes this rank communicated over its ``d`` group in the batch (forward, backward
      and optimizer step): all-reduce counts its tensor, all-gather its gathered output, reduce-scatter its full
      input, send and receive their tensor -- the size nccl-tests calls a message;
    * ``comm/{d}_time_s`` -- seconds during which at least one ``d`` operation was in flight, from its issue to
      its completion (concurrent operations count once);
    * ``comm/{d}_share`` -- that time over the batch's time (training step, backward, optimizer step).

    Each is the maximum over ranks (the busiest rank sets the pace; pipeline stages and tp ranks may differ),
    gathered with one small all-gather in which every rank takes part. ``per_rank`` keeps every rank's values of
    the last logged batch, ``last_ops`` this rank's operations (dimension, operator, bytes).

    **Method.** During a logged batch a ``TorchDispatchMode`` (``comm_recorder.CommRecorder``) sees every
    communication operator -- DTensor's functional collectives (tp), the pipeline's send/receive (pp), DDP's
    bucketed all-reduces and FSDP2's all-reduce / all-gather / reduce-scatter (dp) -- with its tensors and its
    process group, which is matched against the strategy's ``device_mesh["tp"|"pp"|"dp"]`` groups. Bytes are
    therefore exact. The same code runs on gloo and NCCL; what the time means:

    * CPU (gloo): host seconds from the call to the moment gloo marks the work complete. Gloo runs each
      operation to completion on its own threads, so this is the real duration, including waiting for the
      slowest peer to arrive; asynchronous operations (DDP's all-reduces during backward, the pipeline's
      send/receive) overlap computation, so the share says how long communication was in flight, not how long
      the step waited for it.
    * CUDA (NCCL): the device time from a CUDA event recorded on the current stream at the call to one recorded
      on a stream made to wait for the work -- the collective's time on the GPU timeline, including queueing
      behind earlier NCCL work. Reading the events synchronizes the device once per logged batch.

    **Compiled blocks** (``compile=True``) keep running compiled on a logged batch, so the times describe the
    compiled step: the mode declares ``ignore_compile_internals()``, under which dynamo compiles with the mode
    off and runs the compiled code with it on (``parallel/compile.py`` honours it too). The compiled code still
    calls its collectives as operators, which the mode sees; its fused kernels it does not see, and needs not.

    Cost: the dispatch mode runs a Python check on every operator the logged batch dispatches (on the reference
    GPT on CPU, eager, that batch takes up to ~1.7x as long; compiled blocks dispatch far fewer); other batches
    pay nothing. Not yet run on a GPU: the CUDA path is written to the documented stream semantics of
    ``Future.then``, untested. Any strategy works: without
    ``ThreeDStrategy`` all ranks form one data-parallel group (DDP), and in a single process every value is 0.

    Example::

        trainer = L.Trainer(strategy=ThreeDStrategy(tensor_parallel_size=2), callbacks=[CommTimer()])
        # TensorBoard: comm/tp_bytes, comm/tp_time_s, comm/tp_share, comm/pp_..., comm/dp_...
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.per_rank: list[dict[str, float]] = []
        """Per rank, for the last logged batch: ``{d}_bytes``, ``{d}_time_s`` and ``step_time_s``."""
        self.last_ops: list[tuple[str, str, int]] = []
        """This rank's operations of the last logged batch: (dimension, operator, bytes)."""
        self._dim_of_ranks: dict[tuple[int, ...], str] = {}
        self._dims: tuple[str, ...] = DIMS
        self._recorder: CommRecorder | None = None
        self._step_start = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._dim_of_ranks = _dimension_groups(trainer)
        hsdp = HSDP_DIMS if set(HSDP_DIMS) & set(self._dim_of_ranks.values()) else ()
        self._dims = (*DIMS[:-1], *hsdp, DIMS[-1])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch_idx % (self.every_n_steps or trainer.log_every_n_steps):
            return
        self._recorder = CommRecorder(clock_for(pl_module.device))
        self._step_start = self._recorder.clock.now()
        self._recorder.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        recorder.__exit__(None, None, None)
        clock = recorder.clock
        step_end = clock.now()
        clock.synchronize()
        step_time = clock.seconds(step_end, self._step_start)
        intervals: dict[str, list[tuple[float, float]]] = {d: [] for d in self._dims}
        values = {f"{d}_bytes": 0.0 for d in self._dims}
        self.last_ops = []
        for op in recorder.collectives:
            if len(op.group_ranks) == 1:  # a group of one moves nothing
                continue
            dim = self._dim_of_ranks.get(op.group_ranks, "other")
            values[f"{dim}_bytes"] += op.bytes
            end = step_end if op.end is None else op.end  # still in flight when the batch ended
            intervals[dim].append((clock.seconds(op.start, self._step_start), clock.seconds(end, self._step_start)))
            self.last_ops.append((dim, op.op, op.bytes))
        for d in self._dims:
            values[f"{d}_time_s"] = union_seconds(intervals[d])
        values["step_time_s"] = step_time
        self.per_rank = _gather(values, pl_module.device)
        metrics = {}
        for d in self._dims:
            metrics[f"comm/{d}_bytes"] = max(r[f"{d}_bytes"] for r in self.per_rank)
            metrics[f"comm/{d}_time_s"] = max(r[f"{d}_time_s"] for r in self.per_rank)
            metrics[f"comm/{d}_share"] = max(r[f"{d}_time_s"] / r["step_time_s"] for r in self.per_rank)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._recorder is not None:  # a failed batch must not leave the mode active
            self._recorder.__exit__(None, None, None)
            self._recorder = None


def _dimension_groups(trainer: L.Trainer) -> dict[tuple[int, ...], str]:
    """The global ranks of this rank's tp, pp and dp groups -> "tp" / "pp" / "dp" (the layout of any
    strategy other than ThreeDStrategy: the world is one data-parallel group); under HSDP also its
    "dp_shard" and "dp_replicate" groups, where ZeRO's collectives run."""
    if not dist.is_initialized():
        return {}
    dims, rank = dims_of(trainer), dist.get_rank()
    names = ("tp", "pp", "dp") + (("dp_shard", "dp_replicate") if dims.hsdp else ())
    return {tuple(dims.group_ranks(d, rank)): d for d in names}


def _gather(values: dict[str, float], device: torch.device) -> list[dict[str, float]]:
    names = sorted(values)
    mine = torch.tensor([values[n] for n in names], dtype=torch.float64, device=device)
    rows = [mine]
    if dist.is_initialized():
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
    return [dict(zip(names, row)) for row in torch.stack(rows).tolist()]  # one host read for all ranks
