"""Small definitions every layer uses, written once: the bottom of the package (it imports no other module
of it). Schedule names, the positive-integer test, divisors, module names (FQNs), a module's tensors by
name and the local piece of a tensor that may be a DTensor."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
"""The schedules that run several (virtual) stages per pipeline rank."""


def is_positive_int(value: Any) -> bool:
    """A size: an int of at least 1 (``True`` is an int to Python, not a size here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def divisors(n: int) -> list[int]:
    """Every d in 1..n that divides n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` under the root (prefix ""), or ``prefix`` itself (name "")."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def parent_fqn(fqn: str) -> str:
    """The FQN of the module that holds ``fqn`` ("" for a child of the root)."""
    return fqn.rpartition(".")[0]


def named_tensors(module: Any) -> dict[str, Any]:
    """Every parameter and buffer of ``module`` by FQN; a tensor several modules hold (tied weights) under each
    of its names."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def local(tensor: Any) -> Any:
    """This rank's piece of a DTensor; any other value as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
