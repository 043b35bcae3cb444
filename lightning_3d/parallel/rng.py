"""Random numbers under tensor parallelism: one stream where data is replicated, one per tp rank where sharded.

Dropout on a tensor that every tp rank holds whole (the residual stream without sequence parallelism) must
draw the same mask on every tp rank, or the replicas drift apart: that is the default stream, kept equal
across ranks (``parallelize`` starts every rank from rank 0's state, and every rank draws the same amounts).
Dropout on a sharded tensor (attention probabilities of the heads a rank holds, or the sequence shard under
sequence parallelism) must draw *different* masks per tp rank, or head ``h`` and head ``h + n/tp`` would
share a mask. Megatron-LM keeps a second, tp-rank-specific generator for those regions
(seed + 2718 + tp_rank); so does this, switched in by forward hooks on the modules the policy names in
``Plan.sharded_rng_regions``, so the model code stays unchanged.

Draws inside a region never advance the default stream, so regions whose shards differ in size across ranks
cannot desynchronize it either.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from lightning_3d.parallel.tensor_parallel import match_modules

SHARDED_SEED_OFFSET = 2718  # Megatron-LM's offset for the tensor-model-parallel stream


class ShardedRNG:
    """A random stream private to this tp rank, switched in by :meth:`enter` / :meth:`exit` (or :meth:`region`)
    for the host generator and, on CUDA, the device's. Nested regions share the outermost switch."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._depth = 0
        self._default: tuple = ()
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            self._state = self._get()

    def _get(self) -> tuple:
        cpu = torch.get_rng_state()
        return (cpu, torch.cuda.get_rng_state(self.device)) if self.device.type == "cuda" else (cpu,)

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state[1], self.device)

    def enter(self) -> None:
        if self._depth == 0:
            self._default = self._get()
            self._set(self._state)
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._state = self._get()
            self._set(self._default)

    def state_dict(self) -> dict:
        return {"state": self._state}

    def load_state_dict(self, state: dict) -> None:
        self._state = tuple(state["state"])

    @contextmanager
    def region(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.exit()


def apply_sharded_rng(root: nn.Module, patterns: list[str], rng: ShardedRNG) -> None:
    """Run the forward of every module matching ``patterns`` on ``rng``'s stream."""
    for pattern in patterns:
        for fqn in match_modules(root, pattern):
            module = root.get_submodule(fqn)
            module.register_forward_pre_hook(lambda *_: rng.enter())
            module.register_forward_hook(lambda *_: rng.exit())


@contextmanager
def preserved_random_state(sharded: ShardedRNG | None, device: torch.device) -> Iterator[None]:
    """Whatever runs inside leaves every random stream of this rank as it found it: the host's, the
    device's, and the tp-rank stream (``sharded``). For work that must not count as drawing (the pipeline's
    metadata inference), so a run resumed from a checkpoint draws exactly what the uninterrupted one did."""
    devices = [device.index or 0] if device.type == "cuda" else []
    saved = sharded.state_dict() if sharded is not None else None
    with torch.random.fork_rng(devices=devices):
        yield
    if sharded is not None:
        sharded.load_state_dict(saved)


def rank_random_state(sharded: ShardedRNG | None) -> dict[str, Any]:
    """Every random stream of this rank: Python's, the host's, CUDA's, numpy's, and the tp-rank one
    (``sharded``); what a checkpoint keeps per rank so that a resumed run draws what the uninterrupted one did."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if sharded is not None:
        state["sharded"] = sharded.state_dict()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def restore_rank_random_state(state: dict[str, Any], sharded: ShardedRNG | None) -> None:
    """Set this rank's streams to ``state`` (from :func:`rank_random_state`)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "sharded" in state and sharded is not None:
        sharded.load_state_dict(state["sharded"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
