"""Process groups made once per process and layout, however many fits use them.

Every ``Trainer.fit`` (and ``validate``/``test``) sets the strategy's environment up again, and every new
``Trainer`` has a new strategy: without this, each built the layout's device mesh -- a process group per mesh
dimension -- and its other groups anew, and none was ever destroyed, since a group cannot be destroyed while
anything may still use it (DTensor's caches take an equal mesh made later for the same one). A gloo group keeps
three threads and its sockets for the life of the process, so a process that fits many times (a notebook, a
layout sweep, the test suite's workers) gathered hundreds. Here a layout's groups are made the first time and
the same objects handed back after, for as long as the default process group is the same one.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_MADE: dict[Hashable, tuple[Any, Any]] = {}  # key -> (the default group it was made under, what was made)


def once_per_world(key: Hashable, make: Callable[[], T]) -> T:
    """``make()`` the first time ``key`` is asked for under the current default process group, the same object
    after. Collective where ``make`` is: every rank must ask for the same keys in the same order (they run the
    same fits), so that all of them make, or all of them reuse."""
    world = dist.group.WORLD
    made = _MADE.get(key)
    if made is not None and made[0] is world:
        return made[1]
    value = make()
    _MADE[key] = (world, value)  # the world held here cannot be freed, so a new one is never mistaken for it
    return value


def forget() -> None:
    """Drop every group and mesh made here (at exit, once the process groups are destroyed)."""
    _MADE.clear()
