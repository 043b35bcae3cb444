"""Lightning's step methods run through the parallel model: by the pipeline engine under pp > 1; else through
the data-parallel wrapper's forward, inside the loss context (the vocabulary-parallel cross-entropy)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from torch.distributed.fsdp import FSDPModule

from lightning_3d.parallel.parallelize import ParallelModel


def run_step(model: ParallelModel, method: str, args: tuple, kwargs: dict, *, sync_grads: bool,
             redirection: _DDPForwardRedirection) -> Any:
    """Call the LightningModule's ``method`` ("training_step", "validation_step", ...) on this rank's part.

    ``sync_grads=False`` (an accumulation micro-step) leaves a pipeline's data-parallel gradients unreduced.
    ``redirection`` is Lightning's (as in its DDPStrategy): it sends the call through the wrapper's forward,
    where data parallel's hooks run, into ``method``."""
    module = model.module
    if model.engine is not None:
        if method != "training_step":
            return model.engine.run(method, *args, train=False, **kwargs)
        return model.engine.training_step(*args, accumulate_grad_batches=module.trainer.accumulate_grad_batches,
                                          sync_grads=sync_grads, zeroed_after=_zeroed_after(module, args, kwargs),
                                          **kwargs)
    with model.loss_context():
        if model.called is not module or isinstance(module, FSDPModule):  # FSDP2's hooks are on the module
            output = redirection(model.called, module, method, *args, **kwargs)
        else:
            output = getattr(module, method)(*args, **kwargs)
        return output if model.step_result is None else model.step_result(output)


def _zeroed_after(module, args: tuple, kwargs: dict) -> bool:
    """Whether Lightning zeroes the gradients right after this training_step: under automatic optimization, on
    the first batch of each accumulation window (as its ``_AutomaticOptimization._make_zero_grad_fn`` decides)."""
    batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else None)
    if not module.automatic_optimization or not isinstance(batch_idx, int):
        return False
    return batch_idx % module.trainer.accumulate_grad_batches == 0
