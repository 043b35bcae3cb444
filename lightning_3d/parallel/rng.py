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

Inside a ``torch.compile``'d block the switch is an operator of the graph, ``lightning_3d::switch_rng_stream``
(dynamo cannot trace ``torch.get_rng_state``: that would be a graph break), which returns a copy of the
tensor it is given, so the region's input depends on the switch into the stream and the next region's on the
switch out. Inductor draws a region's random numbers on that stream only where it calls random operators
as eager ATen operators (``fallback_random``, which ``parallel/compile.py`` sets for blocks with such regions):
its own random numbers are seeded once per graph, from whichever stream is current when the graph starts.
"""

from __future__ import annotations

import random
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

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
    """Run the forward of every module matching ``patterns`` on ``rng``'s stream (in eager mode by forward hooks
    that switch the generators; traced by ``torch.compile``, through :func:`switch_rng_stream` in the graph)."""
    key = id(rng)
    _STREAMS[key] = rng

    # Closures, not partials: a deep copy of the model (an EMA) keeps functions as they are, so its regions
    # switch this same stream, as the graph's operator (which knows the stream by ``key``) does.
    def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        return _enter_region(rng, key, module, args, kwargs)

    def exit_(module: nn.Module, args: tuple, output: Any) -> Any:
        return _exit_region(rng, key, module, args, output)

    for pattern in patterns:
        for fqn in match_modules(root, pattern):
            module = root.get_submodule(fqn)
            module.register_forward_pre_hook(enter, with_kwargs=True)
            module.register_forward_hook(exit_)


_STREAMS: weakref.WeakValueDictionary[int, ShardedRNG] = weakref.WeakValueDictionary()
"""The streams :func:`switch_rng_stream` switches, by ``id``: a graph's operators take numbers, not objects."""


def _enter_region(rng: ShardedRNG, key: int, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    if not torch.compiler.is_compiling():
        rng.enter()
        return None
    flat, spec = tree_flatten((args, kwargs))
    flat = _switch_first_tensor(flat, key, True, f"{type(module).__name__} has no tensor among its inputs")
    return tree_unflatten(flat, spec)


def _exit_region(rng: ShardedRNG, key: int, module: nn.Module, args: tuple, output: Any) -> Any:
    if not torch.compiler.is_compiling():
        rng.exit()
        return None
    flat, spec = tree_flatten(output)
    return tree_unflatten(_switch_first_tensor(flat, key, False, f"{type(module).__name__} returns no tensor"), spec)


def _switch_first_tensor(flat: list, key: int, enter: bool, missing: str) -> list:
    """``flat`` with its first tensor passed through :func:`switch_rng_stream`."""
    first = next((i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)), None)
    if first is None:
        raise TypeError(f"{missing}: a module on the tp-rank random stream inside a compiled block needs one, to"
                        " order the stream's switch in the graph. Set its dropout to 0, or compile=False.")
    x = flat[first]
    if isinstance(x, DTensor):  # the operator has no sharding rule: it switches on the local shard
        x = DTensor.from_local(switch_rng_stream(x.to_local(), key, enter), x.device_mesh, x.placements,
                               run_check=False, shape=x.shape, stride=x.stride())
    else:
        x = switch_rng_stream(x, key, enter)
    return [*flat[:first], x, *flat[first + 1:]]


@torch.library.custom_op("lightning_3d::switch_rng_stream", mutates_args=())
def switch_rng_stream(x: torch.Tensor, stream: int, enter: bool) -> torch.Tensor:
    """Switch into (``enter``) or out of the tp-rank stream registered as ``stream``; a copy of ``x``, which
    orders the switch in a compiled graph (the operator cannot return ``x`` itself: its output may not alias an
    input). Costs one copy of a region's input and one of its output, only in compiled blocks."""
    rng = _STREAMS[stream]
    rng.enter() if enter else rng.exit()
    return x.clone()


@switch_rng_stream.register_fake
def _(x: torch.Tensor, stream: int, enter: bool) -> torch.Tensor:
    return torch.empty_like(x)


switch_rng_stream.register_autograd(lambda ctx, grad: (grad, None, None))


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
