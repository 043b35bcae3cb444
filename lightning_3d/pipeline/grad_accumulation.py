"""Whether the backward running now only adds to gradients that a later backward of the same step reduces.

A pipeline stage runs one backward per micro-batch and reduces its gradients over dp once, after the last
(``pipeline/grad_sync.py``). Until then each backward adds its micro-batch's gradient to what the stage holds,
and a NaN/Inf added there stays (a sum with a non-finite term is not finite). So a check that must see the
gradients before the reduction (NaNGuard's, ``callbacks/grad_checks.py``) can look once, at the stage's last
backward, at what was accumulated, instead of at every micro-batch's gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

_accumulating = False


@contextmanager
def accumulating(on: bool = True) -> Iterator[None]:
    """Marks the backward run inside as one whose gradients a later backward of this step reduces."""
    global _accumulating
    before, _accumulating = _accumulating, on
    try:
        yield
    finally:
        _accumulating = before


def is_accumulating() -> bool:
    """True inside a backward whose gradients a later backward of this step reduces (:func:`accumulating`)."""
    return _accumulating
