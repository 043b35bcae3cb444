"""The pipeline's metadata inference must not draw random numbers.

The first time a schedule runs, each ``torch.distributed.pipelining`` stage runs a real forward of its
module to learn the shapes it will send and receive. With dropout, that forward draws from the random
streams: once, in the first step, of the run that started from scratch; and once more, at the first step
after the restore, in a run resumed from a checkpoint -- so the resumed run's dropout masks would differ
from the uninterrupted run's. Running the inference inside ``random_state()`` (which restores every stream
afterwards, ``lightning_3d.parallel.rng.preserved_random_state``) makes it draw nothing in either.

A stage after the first runs that forward on tensors PyTorch makes from the shapes it receives, with
``torch.empty``: whatever bytes the memory held. A stage that runs the model's forward as written
(``pipeline.as_written``) also receives the model's inputs, and a forward that indexes with one of them --
``labels=`` in a Hugging Face model's loss, ``targets`` in nanoGPT's -- would fail on those bytes (an
out-of-bounds class index; on CUDA a device-side assert). They are zeros instead: a valid index for any
table.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable

import torch
from torch import Tensor
from torch.distributed.pipelining import PipelineStage


_RUNNING = [0]  # metadata inferences in progress in this process


def metadata_inference_running() -> bool:
    """Whether a stage's metadata inference is running now: a forward that is not the training's (what watches
    the model's calls, e.g. the experts' token counts, leaves it out)."""
    return _RUNNING[0] > 0


@contextmanager
def _running():
    _RUNNING[0] += 1
    try:
        yield
    finally:
        _RUNNING[0] -= 1


def isolate_metadata_inference(stage: PipelineStage, random_state: Callable[[], AbstractContextManager]) -> None:
    # PipelineStage has no hook around its metadata inference; wrapping the bound method on this instance is
    # the narrowest change (PyTorch 2.13 names it _forward_metadata_inference). If a later PyTorch renames
    # it, nothing breaks: only a resumed run with dropout under pp would draw differently (and its test fails).
    inference = getattr(stage, "_forward_metadata_inference", None)
    if inference is None:
        return

    def run(*args: Any, **kwargs: Any) -> Any:
        with random_state(), _running():
            return inference(*args, **kwargs)

    stage._forward_metadata_inference = run

    # (PyTorch 2.13 names it _to_tensor; without it the received tensors stay torch.empty's.)
    to_tensor = getattr(stage, "_to_tensor", None)
    if to_tensor is not None:
        def zeros_for_received(arg: Any) -> Tensor:
            tensor = to_tensor(arg)
            if not isinstance(arg, Tensor):  # made from metadata, not the caller's tensor
                with torch.no_grad():
                    tensor.zero_()
            return tensor

        stage._to_tensor = zeros_for_received

    # After inference PyTorch reshards the stage's FSDP2 modules and sets their gradients to None. An evaluation
    # stage's inference can run inside an accumulation window (validation at val_check_interval=3 with
    # accumulate_grad_batches=2, or the first evaluation batch of a new shape): the gradients accumulated so far
    # must survive it. (PyTorch 2.13 names the clean-up _post_metadata_inference_cleanup.)
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    if cleanup is None:
        return

    def cleanup_keeping_grads() -> None:
        grads = [(p, p.grad) for p in stage.submod.parameters()]
        cleanup()
        for param, grad in grads:
            param.grad = grad

    stage._post_metadata_inference_cleanup = cleanup_keeping_grads
