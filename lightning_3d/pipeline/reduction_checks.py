"""Checks that look at a pipeline stage's gradients once per step, right before the stage reduces them over dp.

A stage runs one backward per micro-batch and accumulates its gradients, unreduced, until the schedule's
reduction (``GradSyncStage.perform_reduce_grad``, ``pipeline/grad_sync.py``). A check that must see each
rank's own gradients before data parallel spreads them (NaNGuard names the rank a NaN/Inf came from) can look
there, once per step, at what the micro-batches accumulated -- a NaN/Inf stays in a sum -- instead of through
a Python hook on every gradient of every micro-batch (``callbacks/grad_checks.py``).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

_checks: list[Callable[[nn.Module], None]] = []


def before_reduction(check: Callable[[nn.Module], None]) -> Callable[[], None]:
    """Run ``check(stage_module)`` on each pipeline stage's module right before its gradients are reduced over
    dp (every schedule step that ran a backward); returns what removes it."""
    _checks.append(check)
    return lambda: _checks.remove(check)


def run_before_reduction(module: nn.Module) -> None:
    """What ``GradSyncStage`` calls before it reduces ``module``'s gradients."""
    for check in list(_checks):
        check(module)
