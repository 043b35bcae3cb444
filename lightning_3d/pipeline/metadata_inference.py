"""The pipeline's metadata inference must not draw random numbers.

The first time a schedule runs, each ``torch.distributed.pipelining`` stage runs a real forward of its
module to learn the shapes it will send and receive. With dropout, that forward draws from the random
streams: once, in the first step, of the run that started from scratch; and once more, at the first step
after the restore, in a run resumed from a checkpoint -- so the resumed run's dropout masks would differ
from the uninterrupted run's. Running the inference inside ``random_state()`` (which restores every stream
afterwards, ``lightning_3d.parallel.rng.preserved_random_state``) makes it draw nothing in either.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

from torch.distributed.pipelining import PipelineStage


def isolate_metadata_inference(stage: PipelineStage, random_state: Callable[[], AbstractContextManager]) -> None:
    # PipelineStage has no hook around its metadata inference; wrapping the bound method on this instance is
    # the narrowest change (PyTorch 2.13 names it _forward_metadata_inference). If a later PyTorch renames
    # it, nothing breaks: only a resumed run with dropout under pp would draw differently (and its test fails).
    inference = getattr(stage, "_forward_metadata_inference", None)
    if inference is None:
        return

    def run(*args: Any, **kwargs: Any) -> Any:
        with random_state():
            return inference(*args, **kwargs)

    stage._forward_metadata_inference = run
