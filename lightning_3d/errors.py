"""Every error class lightning_3d raises, in one module at the bottom of the package (it imports no other
module of it), so any layer can raise any of them without importing upward. Each is also importable from the
module that raises it (``lightning_3d.parallel.config.ParallelConfigError``, ...), as before.

Configuration errors are ``ValueError``s (raised before any process talks to another); errors found while
running are ``RuntimeError``s; a refused checkpoint is an ``UnpicklingError``, as torch's own refusal is.
"""

from __future__ import annotations

import pickle


class ParallelConfigError(ValueError):
    """A layout or feature setting that cannot work; the message says which values and what to change."""


class PolicyError(ValueError):
    """A policy that cannot be found or cannot handle the model; the message says what to change."""


class LayoutError(ParallelConfigError, PolicyError):
    """The model and the layout do not fit each other -- heads, key/value heads or the vocabulary not divisible
    by tensor_parallel_size, fewer blocks than pipeline stages, a ``pipeline_split`` that does not list the
    model's blocks: the user changes a size (the layout's or the model config's), not the policy. Caught as
    either parent (it was a ``PolicyError`` before)."""


class InitError(RuntimeError):
    """A model that the chosen init cannot handle; the message names the modules and the way out."""


class ShardedShapeError(RuntimeError):
    """A block cannot run on the shapes tensor parallelism gives it on this rank; the message says why."""


class StepPatternError(RuntimeError):
    """A pattern in the user's step that pipeline or tensor parallelism cannot run as one process does."""


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, or does not fit the model it is loaded into."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A file that asks to run code, or to build objects of types not known to be safe, while it is read."""


class PlannerError(ValueError):
    """Inputs the planner cannot reason about; the message says which values and what to change."""


class NoLayoutFits(PlannerError):
    """No layout fits the devices' memory; the message gives the smallest need and what to change.
    ``smallest_bytes`` is that need per rank (None where the raiser did not give it)."""

    def __init__(self, message: str, *, smallest_bytes: float | None = None) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
