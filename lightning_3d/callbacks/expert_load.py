"""ExpertLoadMonitor: how many tokens each mixture-of-experts layer sends to each of its experts."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.callbacks.layout import dims_of
from lightning_3d.pipeline.metadata_inference import metadata_inference_running
from lightning_3d.policies.experts import is_dispatched_experts


class ExpertLoadMonitor(L.Callback):
    """Logs, after a training batch every ``every_n_steps`` optimizer steps (Lightning's ``log_every_n_steps`` by
    default), per mixture-of-experts layer (``expert_load/<its experts' FQN>/...``), the number of (token, choice)
    pairs its router sent to each expert, over the whole batch of every rank:

    * ``min``, ``max`` and ``mean`` over the layer's experts -- a collapsed router shows as a max far above the
      mean and a min near 0.

    The counts are what one process counts for the same batch: each rank counts the choices its experts modules
    are called with (transformers' experts modules, ``experts(hidden_states, top_k_index, top_k_weights)``;
    training forwards only, not a pipeline's metadata inference nor a shape check), and one all-reduce over the
    world per logged batch sums them (divided by tp, whose ranks route the same tokens); other batches count
    nothing. Every rank takes part, so it cannot hang.

    Example::

        trainer = L.Trainer(strategy=ThreeDStrategy(expert_parallel_size=2), callbacks=[ExpertLoadMonitor()])
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.counting = False
        """Whether this batch is counted (a logged one)."""
        self.counts: dict[str, Tensor] = {}
        """Experts module FQN -> pairs sent to each of its experts in the current batch (this rank's)."""
        self._layers: dict[str, int] = {}  # every layer's experts module, of every pipeline stage -> its experts
        self._handles: list = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = {}
        for name, module in pl_module.named_modules():
            if is_dispatched_experts(module):
                held[name] = module.down_proj.shape[0]
                self._handles.append(module.register_forward_pre_hook(self._counter(name, held[name])))
        stages = [held]
        if dist.is_initialized():  # under pp a rank holds its stage's layers; the table has every stage's
            stages = [None] * dist.get_world_size()
            dist.all_gather_object(stages, held)
        # (the stages in rank order: the model's order of its layers)
        self._layers = {name: experts for layers in stages for name, experts in layers.items()}

    def _counter(self, name: str, experts: int):
        def count(module: nn.Module, args: tuple) -> None:
            choices = args[1] if len(args) > 1 else None
            # Real tensors of a training forward only: not a shape check's fake ones, not the pipeline's inference.
            if (not self.counting or type(choices) is not Tensor or choices.is_meta or metadata_inference_running()
                    or not module.training):
                return
            counts = torch.bincount(choices.reshape(-1), minlength=experts)
            self.counts[name] = self.counts[name] + counts if name in self.counts else counts
        return count

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts = {}
        every = self.every_n_steps or trainer.log_every_n_steps
        self.counting = bool(self._layers) and trainer.global_step % every == 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not self.counting:
            return
        width = max(self._layers.values())
        table = torch.zeros(len(self._layers), width, dtype=torch.long, device=pl_module.device)
        for row, name in enumerate(self._layers):
            if name in self.counts:  # (a layer of another pipeline stage: zeros here)
                table[row, :self.counts[name].numel()] = self.counts[name]
        if dist.is_initialized():
            dist.all_reduce(table)
        table = (table // dims_of(trainer).tp).tolist()  # the one host read
        for (name, experts), row in zip(self._layers.items(), table):
            loads = row[:experts]
            for stat, value in (("min", min(loads)), ("max", max(loads)), ("mean", sum(loads) / experts)):
                pl_module.log(f"expert_load/{name}/{stat}", float(value), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
