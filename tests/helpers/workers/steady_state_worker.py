"""What a steady-state training step runs besides the model: modes on the stack and host syncs, per step.

    python -m torch.distributed.run --nproc-per-node 2 steady_state_worker.py OUT_DIR LAYOUT [LAYOUT ...]

LAYOUT is a key of :data:`LAYOUTS` ("one" runs in one process, for the reference). For each layout three runs of
the reference GPT: "bare" (no callbacks, no logger), "default" (Lightning's default callbacks -- progress
bar, ModelCheckpoint, model summary -- and a TensorBoard logger writing every step) and "monitors" ("default"
plus lightning_3d's callbacks at their default intervals, which with ``log_every_n_steps=1`` is every step). Rank 0 writes ``LAYOUT_RUN.json``:

* ``modes``: per step of steps 2-4, the deepest TorchFunctionMode / TorchDispatchMode stack seen while a block
  runs forward or its output's gradient is computed; ``blocks_seen`` how many such moments were recorded.
* ``syncs``: per step of steps 5-7, on each rank, copies of a device value to the host
  (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``float()``) and object collectives
  (``broadcast_object_list``, ``all_gather_object``, ...), counted from the SIGTERM check Lightning runs
  before each batch (Lightning's own reads a broadcast device flag with ``.item()``, a host sync per step on a
  GPU; the strategy's, ``strategies/stop_signal.py``, reads nothing from a device) to the last user callback's
  ``on_train_batch_end`` (Lightning's progress bar and logger, which read the logged values after the user's
  callbacks, are not counted).
* ``copies``: per step of steps 5-7, on each rank, ``.tolist()`` and ``.cpu()`` calls in the same window. On
  the host they read memory without any dispatched operator, so ``syncs`` cannot see them; on a GPU, those of
  a device tensor are syncs (one each for GradNormMonitor, CommTimer and PipelineMonitor in a step that logs),
  those of a host tensor are not (PipelineMonitor's picture, on rank 0). Reported, not asserted.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import CommTimer, GradNormMonitor, NaNGuard, PipelineMonitor, ThroughputMonitor
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

LAYOUTS = {"one": {}, "pp2": dict(pipeline_parallel_size=2, num_microbatches=4),
           "tp2": dict(tensor_parallel_size=2)}
MODE_STEPS = (1, 2, 3)  # batch indices: steps 2-4
SYNC_STEPS = (4, 5, 6)  # steps 5-7
KINDS = ("bare", "default", "monitors")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


class _CountSyncs(TorchDispatchMode):
    """Counts reads of tensor values by the host, less those of the optimizer's step counters: torch keeps
    those on the host on a GPU run too (Adam without ``capturable``/``fused``), where reading them syncs nothing."""

    def __init__(self, host_counters: set[int]) -> None:
        super().__init__()
        self.count, self.host_counters, self.where = 0, host_counters, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.host_counters:
            self.count += 1
            self.where.append("".join(traceback.format_stack(limit=8)[:-1]))
        return func(*args, **(kwargs or {}))


class Probe(L.Callback):
    def __init__(self) -> None:
        self.modes: dict[int, list[int]] = {}
        self.syncs: dict[int, int] = {}
        self.copies: dict[int, int] = {}
        self.blocks_seen = 0
        self.where: list[str] = []  # the stack of each sync counted (for a failing test's message)
        self._counter: _CountSyncs | None = None
        self._objects = 0
        self._step: int | None = None
        self._next_batch = 0
        self._at_check = 0  # syncs of the SIGTERM check before the batch being counted

    def on_fit_start(self, trainer, pl_module) -> None:
        for module in pl_module.modules():
            if type(module).__name__ == "Block":
                module.register_forward_pre_hook(self._forward)
                module.register_forward_hook(self._output)
        self._originals = {name: getattr(dist, name) for name in OBJECT_COLLECTIVES}
        for name, original in self._originals.items():

            def counted(*args, _original=original, **kwargs):
                self._objects += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def teardown(self, trainer, pl_module, stage) -> None:
        for name, original in getattr(self, "_originals", {}).items():
            setattr(dist, name, original)

    def _seen(self) -> None:
        if self._step is not None:
            deepest = self.modes.setdefault(self._step, [0, 0])
            deepest[0] = max(deepest[0], torch._C._len_torch_function_stack())
            deepest[1] = max(deepest[1], _len_torch_dispatch_stack())
            self.blocks_seen += 1

    def _forward(self, module, args) -> None:
        self._seen()

    def _output(self, module, args, output) -> None:
        tensor = output[0] if isinstance(output, tuple) else output
        if self._step is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: self._seen())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self._count_from_the_stop_check(trainer)
        if batch_idx in MODE_STEPS:
            self._step = batch_idx
        if batch_idx in SYNC_STEPS:
            self._objects, self._copies, self._counter = 0, 0, _CountSyncs(self._host_counters(trainer))
            self._counter.__enter__()
            self._count_copies()

    def _count_from_the_stop_check(self, trainer) -> None:
        """Count, for a batch in SYNC_STEPS, the SIGTERM check that precedes it (whichever check runs: the
        strategy's, installed at the start of training, or Lightning's own). Not the data loader's work between
        the check and the batch: its sampler reads host tensors."""
        loop = trainer.fit_loop.epoch_loop
        check = loop._broadcast_sigterm_tensor

        def counted() -> None:
            if self._next_batch not in SYNC_STEPS:
                return check()
            counter, objects = _CountSyncs(self._host_counters(trainer)), self._objects
            with counter:
                check()
            self._at_check = counter.count + self._objects - objects
            self.where.extend(counter.where)

        loop._broadcast_sigterm_tensor = counted

    @staticmethod
    def _host_counters(trainer) -> set[int]:
        return {id(state["step"]) for optimizer in trainer.optimizers for state in optimizer.state.values()
                if isinstance(state.get("step"), torch.Tensor)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step = None

    def _count_copies(self) -> None:
        self._methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}
        for name, original in self._methods.items():

            def counted(tensor, *args, _original=original, **kwargs):
                self._copies += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)

    def end_of_batch(self, batch_idx: int) -> None:
        """After the last user callback's ``on_train_batch_end`` (:class:`EndOfBatch`)."""
        self._next_batch = batch_idx + 1
        if self._counter is not None:
            for name, original in self._methods.items():
                setattr(torch.Tensor, name, original)
            self._counter.__exit__(None, None, None)
            self.syncs[batch_idx] = self._at_check + self._counter.count + self._objects
            self._at_check = 0
            self.copies[batch_idx] = self._copies
            self.where.extend(self._counter.where)
            self._counter = None


class EndOfBatch(L.Callback):
    """The last user callback: closes the probe's count once every callback before it has finished the batch
    (the probe opens it first, so that its mode sits below any mode a callback enters, e.g. CommTimer's)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.probe.end_of_batch(batch_idx)


def monitors(layout: str) -> list[L.Callback]:
    """lightning_3d's callbacks at their default intervals (PipelineMonitor only with a pipeline: without one it
    warns, and the tests turn warnings into errors)."""
    pipeline = LAYOUTS[layout].get("pipeline_parallel_size", 1) > 1
    return [NaNGuard(), GradNormMonitor(), CommTimer(), ThroughputMonitor(), *([PipelineMonitor()] if pipeline else [])]


def run(layout: str, kind: str, out_dir: Path) -> dict:
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(config=GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16))
    data = SyntheticDataModule(seq_len=16, batch_size=8, num_train_samples=8 * 8)
    probe = Probe()
    devices = int(os.environ.get("WORLD_SIZE", 1))
    bare = kind == "bare"
    callbacks = [probe, *(monitors(layout) if kind == "monitors" else []), EndOfBatch(probe)]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=ThreeDStrategy(**LAYOUTS[layout]), max_steps=8,
        callbacks=callbacks, enable_progress_bar=not bare, enable_checkpointing=not bare, enable_model_summary=not bare,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=False if bare else TensorBoardLogger(str(out_dir / f"tb_{layout}")),
        default_root_dir=str(out_dir / f"root_{layout}_{kind}"))
    trainer.fit(module, data)
    counts = [None] * max(devices, 1)
    if dist.is_initialized():
        dist.all_gather_object(counts, (probe.syncs, probe.copies))
    else:
        counts = [(probe.syncs, probe.copies)]
    return {"modes": probe.modes, "blocks_seen": probe.blocks_seen, "syncs": [syncs for syncs, _ in counts],
            "copies": [copies for _, copies in counts], "where": probe.where[:3]}


def main(out_dir: str, layouts: list[str]) -> None:
    out = Path(out_dir)
    for layout in layouts:
        for kind in KINDS:
            result = run(layout, kind, out)
            if int(os.environ.get("RANK", 0)) == 0:
                (out / f"{layout}_{kind}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
