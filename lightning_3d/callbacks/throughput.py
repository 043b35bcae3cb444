"""ThroughputMonitor: samples and tokens per second, model FLOP utilization, and stragglers."""

from __future__ import annotations

import time

import lightning as L
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from lightning_3d.callbacks.layout import dims_of
from lightning_3d.device_peaks import dense_bf16_tflops
from lightning_3d.parallel.clip import local_pieces


class ThroughputMonitor(L.Callback):
    """Logs every ``every_n_steps`` training batches (default: the Trainer's ``log_every_n_steps``):

    * ``throughput/samples_per_sec`` and ``throughput/tokens_per_sec`` of the whole run (all dp replicas),
      from the time between consecutive training batches;
    * ``throughput/mfu`` -- model FLOP utilization, ``6 * N * tokens/s / (peak * world)`` with ``N`` the
      parameters of the whole model (each shard and stage counted once; the attention-score FLOPs are left
      out, as in the usual 6N estimate), when the device's peak is known (``lightning_3d.device_peaks``) or
      given;
    * ``throughput/step_time_skew`` -- the slowest rank's batch time over the fastest's (1.0 = no straggler).

    Batch shapes: samples = dim 0 of the batch's first tensor per dp replica; tokens = samples x dim 1.

    Example::

        trainer = L.Trainer(strategy="3d", callbacks=[ThroughputMonitor(peak_flops=312e12)])
    """

    def __init__(self, every_n_steps: int | None = None, peak_flops: float | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.peak_flops = peak_flops
        self._last: float | None = None
        self.model_parameters: int | None = None
        """Parameters of the whole model (every shard and stage once), counted when training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops is None and pl_module.device.type == "cuda":
            tflops = dense_bf16_tflops(torch.cuda.get_device_name(pl_module.device))
            self.peak_flops = None if tflops is None else tflops * 1e12
        self.model_parameters = round(self._whole_model_parameters(trainer, pl_module))
        self._last = None

    def _whole_model_parameters(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        dims = dims_of(trainer)
        share = 0.0
        for param in pl_module.parameters():
            share += sum(local.numel() / copies for local, copies in local_pieces(param, dims))
        total = torch.tensor([share], dtype=torch.float64, device=pl_module.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        return total.item()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        last, self._last = self._last, now
        every = self.every_n_steps or trainer.log_every_n_steps
        if last is None or batch_idx % every:
            return
        seconds = torch.tensor([now - last], dtype=torch.float64, device=pl_module.device)
        times = [seconds]
        if dist.is_initialized():  # every rank takes part: the same batches are logged everywhere
            times = [torch.zeros_like(seconds) for _ in range(dist.get_world_size())]
            dist.all_gather(times, seconds)
        # Device tensors, not read here: Lightning reads them with the step's other logged values.
        times = torch.cat(times)
        step = times.max()  # the run moves at the pace of its slowest rank
        first = next(x for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor))
        samples = first.shape[0] * dims_of(trainer).dp
        tokens = samples * (first.shape[1] if first.dim() > 1 else 1)
        metrics = {"throughput/samples_per_sec": samples / step, "throughput/tokens_per_sec": tokens / step,
                   "throughput/step_time_skew": step / times.min()}
        if self.peak_flops:
            metrics["throughput/mfu"] = 6 * self.model_parameters * tokens / step / (self.peak_flops * trainer.world_size)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
