"""The exact init without the whole model in memory: record the build on the meta device, replay it op by op.

A model whose init cannot be replayed module by module (``parallel.init_record``: nanoGPT's
``self.apply(_init_weights)``, Hugging Face's ``post_init()``) is built as written, on the host, on global rank 0
and streamed into every rank's shards (``weight_init.stream_from_rank0``). Built for real, that build is the
whole model. Here it is built on the meta device instead, under an :class:`InitTape`: a
``TorchDispatchMode`` that notes every aten op the build runs, with its arguments (tensors by the storage they
view). :meth:`InitTape.tensors` then runs the same ops on the host, in the same order, from the same random
state, so every draw gets the same numbers as the build as written -- but it holds a tensor only while its
value is still needed:

* a value that a later op overwrites whole before anything reads it (``nn.Linear``'s own kaiming draw, which
  nanoGPT and Hugging Face redraw with ``normal_``) is drawn into scratch memory and dropped at once: the
  random stream advances as it did, nothing is kept;
* an op that neither draws random numbers nor makes a value still needed is skipped;
* a parameter or buffer is handed out (to be streamed) right after the last op that touches it, and freed.

So the host holds the tensors being initialized at one moment -- one or two, for the models above -- instead of
the model, and :attr:`InitTape.peak_bytes` says how much before anything is allocated.

The build runs with the factory functions sent to the meta device by :class:`OnMeta`, not by
``torch.device("meta")``: Hugging Face skips ``post_init()``'s init under that context manager (it tests
``torch.tensor([]).device``), and the tape must see the init as written. ``torch.tensor(data)`` stays on the
host, as written, and its values are kept.

What the tape cannot replay is found before any weight is made (:attr:`InitTape.problem`): a meta tensor
made outside the build, a view that reads a storage as another dtype, a tensor on an accelerator (a device
the build names itself). The strategy then builds on the host.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_3d.common import named_tensors
from lightning_3d.parallel.init_record import storage_key

# Constructors that take no data: sent to the meta device. ``torch.tensor(data)`` and the like keep their values.
_WITH_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer}
# In-place ops that write every element of their target without reading it.
_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_",
                         "geometric_", "cauchy_", "log_normal_", "copy_"})
# Ops that draw random numbers but take no generator argument.
_RANDOM_WITHOUT_GENERATOR = frozenset({"native_dropout"})


class OnMeta(TorchFunctionMode):
    """Factory calls without a device make meta tensors (as ``torch.device("meta")``, which Hugging Face
    detects and then skips its init); calls given data keep it on the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is None and func not in _WITH_DATA and func in _constructors():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _constructors() -> set:
    from torch.utils._device import _device_constructors  # the list torch.device(...) as a context uses
    return _device_constructors()


@dataclass(frozen=True)
class _View:
    """A tensor argument, as the storage it views: replayed as ``base.as_strided(size, stride, offset)``."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class _Op:
    func: Any
    flat_args: list  # tree_flatten of (args, kwargs): _View for tensors, values otherwise
    spec: Any
    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)  # storages written in place
    overwrites: set[int] = field(default_factory=set)  # of those: written whole, not read
    made: list[tuple[int, int]] = field(default_factory=list)  # (output leaf index, storage key) it allocates
    random: bool = False


@dataclass
class _Storage:
    dtype: torch.dtype
    numel: int
    constant: Tensor | None = None  # a host tensor made outside the tape (torch.tensor(data)): its values


class InitTape(TorchDispatchMode):
    """Enter (with :class:`OnMeta` outside it) around a build on the meta device; then :meth:`finish` with
    the built model, check :attr:`problem`, then :meth:`order` and :meth:`tensors`. See the module doc."""

    def __init__(self, rng_state: Tensor) -> None:
        super().__init__()
        self.rng_state = rng_state
        """The host random state the build started from: the replay draws from it."""
        self.ops: list[_Op] = []
        self.storages: dict[int, _Storage] = {}
        self.problem: str | None = None
        self._keep: list[Tensor] = []  # every tensor seen, kept alive so storage keys stay unique
        self._finals: dict[int, list[tuple[str, _View]]] = {}  # storage -> the model's (name, view) of it
        self._plan: list[list[int]] = []  # per op: the storages to hand out (final) or free after it
        self._keep_op: list[bool] = []  # per op: whether the replay runs it
        self._last_use: dict[int, int] = {}  # storage -> the last op that touches it
        self.peak_bytes = 0
        """The most host bytes the replay holds at once (planned by :meth:`finish`, before anything runs)."""

    # ------------------------------------------------------------------ recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.problem is None:
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func, args, kwargs, out) -> None:
        flat, spec = tree_flatten((args, kwargs))
        op = _Op(func, [], spec, random=_is_random(func))
        schema = func._schema.arguments
        written = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
        named = [*zip([a.name for a in schema], args), *kwargs.items()]
        arg_of = [name for name, value in named for _ in tree_flatten(value)[0]]  # each leaf's argument
        for leaf, name in zip(flat, arg_of):
            if not isinstance(leaf, Tensor):
                op.flat_args.append(_on_host(leaf))
                continue
            view = self._view(leaf)
            if view is None:
                return
            op.flat_args.append(view)
            if name in written:
                op.writes.add(view.key)
                whole = (name == "out" or _base_name(func) in _OVERWRITES) and self._covers(view)
                if whole:
                    op.overwrites.add(view.key)
                    continue
            op.reads.add(view.key)
        out_flat, _ = tree_flatten(out)
        for j, leaf in enumerate(out_flat):
            if isinstance(leaf, Tensor):
                if leaf.device.type not in ("meta", "cpu"):  # a device given explicitly: not replayed on the host
                    self.problem = f"the build makes a {tuple(leaf.shape)} tensor on {leaf.device} ({func})"
                    return
                key = storage_key(leaf)
                if key not in self.storages:
                    self._keep.append(leaf)
                    self.storages[key] = _Storage(leaf.dtype, _storage_numel(leaf))
                    op.made.append((j, key))
        self.ops.append(op)

    def _view(self, tensor: Tensor) -> _View | None:
        key = storage_key(tensor)
        storage = self.storages.get(key)
        if storage is None:
            if tensor.is_meta:
                self.problem = (f"a {tuple(tensor.shape)} tensor on the meta device made before the build reaches"
                                " it (the tape cannot know its values)")
                return None
            if tensor.device.type != "cpu":
                self.problem = (f"a {tuple(tensor.shape)} tensor on {tensor.device} reaches the build (the replay"
                                " runs on the host)")
                return None
            self._keep.append(tensor)  # a host tensor made outside the tape: kept by value
            storage = self.storages[key] = _Storage(tensor.dtype, _storage_numel(tensor),
                                                    constant=_whole_storage(tensor).clone())
        if tensor.dtype != storage.dtype:
            self.problem = f"a view reads a {storage.dtype} storage as {tensor.dtype}"
            return None
        return _View(key, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)

    def _covers(self, view: _View) -> bool:
        """Whether ``view`` is every element of its storage, each once."""
        numel = math.prod(view.size)
        if numel != self.storages[view.key].numel or view.offset != 0:
            return False
        dense = sorted((st, sz) for st, sz in zip(view.stride, view.size) if sz > 1)
        expected = 1
        for stride, size in dense:
            if stride != expected:
                return False
            expected *= size
        return True

    # ------------------------------------------------------------------ analysis
    def finish(self, model: nn.Module) -> None:
        """Note the tensors the build ended with (``model``'s parameters and buffers, by name) and plan the
        replay: what each op must run for, and when each storage is handed out or freed."""
        for name, tensor in named_tensors(model).items():
            view = self._view(tensor) if self.problem is None else None
            if view is None:
                return
            self._finals.setdefault(view.key, []).append((name, view))
        for i, op in enumerate(self.ops):
            for key in _touched(op):
                self._last_use[key] = i
        # A draw always runs: the random stream must advance as it did.
        self._keep_op, self._plan = self._schedule(set(self._finals), keep_draws=True)
        self.peak_bytes = self._simulate()

    def _schedule(self, finals: set[int], keep_draws: bool) -> tuple[list[bool], list[list[int]]]:
        """Which ops a replay that must produce the storages ``finals`` runs, and after each op the storages it
        hands out (a final value, at its last touch) or frees (no later op needs it). Planned backwards: a value
        is needed if a later op that runs reads it before overwriting it, or it is one of ``finals``."""
        needed = set(finals)
        keep_op = [False] * len(self.ops)
        plan: list[list[int]] = [[] for _ in self.ops]
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            plan[i] = [key for key in _touched(op) if self._last_use[key] == i or key not in needed]
            useful = bool((op.writes | {k for _, k in op.made}) & needed)
            keep_op[i] = useful or (keep_draws and op.random)
            needed -= op.overwrites | {k for _, k in op.made}
            if keep_op[i]:  # what it reads must be there when it runs
                needed |= op.reads | (op.writes - op.overwrites)
        return keep_op, plan

    def order(self) -> list[list[str]]:
        """The model's tensor names grouped by storage (tied weights together), in the order replay hands
        them out: every rank walks this order to receive them."""
        handed = [key for i, keys in enumerate(self._plan) for key in keys
                  if key in self._finals and self._last_use[key] == i]
        handed += [key for key in self._finals if key not in set(handed)]  # constants no op touched
        return [[name for name, _ in self._finals[key]] for key in handed]

    def _simulate(self) -> int:
        live: dict[int, int] = {}
        peak = 0
        for i, op in enumerate(self.ops):
            if self._keep_op[i]:
                for key in _touched(op):
                    storage = self.storages[key]
                    live.setdefault(key, storage.numel * storage.dtype.itemsize)
                peak = max(peak, sum(live.values()))
            for key in self._plan[i]:
                live.pop(key, None)
        return peak

    # ------------------------------------------------------------------ replay
    def tensors(self) -> Iterator[tuple[list[str], Tensor]]:
        """Run the build's ops on the host from :attr:`rng_state`; yields the names of each of :meth:`order`'s
        groups with its tensor once its value is final (valid until the next one). Run to its end, it leaves
        the host generator where the build as written leaves it."""
        if self.problem is not None:
            raise RuntimeError(f"the init tape cannot be replayed: {self.problem}")
        torch.set_rng_state(self.rng_state)
        yield from self._replay(set(self._finals), self._keep_op, self._plan, torch.device("cpu"), seed=None)

    def seeded_tensors(self, names: set[str], device: torch.device, seed: int) -> Iterator[tuple[list[str], Tensor]]:
        """The fast route (``model_init="fast"``): only the tensors ``names`` are made (one rank's pipeline
        stages), on ``device``, by the build's own ops -- but every draw from a seed of its own, derived from
        ``seed`` and the draw's place in the build, instead of from one stream in build order. So a tensor's
        values depend on the seed and the build, not on which other tensors are made, nor on the layout; they
        are not the numbers the build as written draws. Yields like :meth:`tensors`; leaves the random state as
        it found it."""
        if self.problem is not None:
            raise RuntimeError(f"the init tape cannot be replayed: {self.problem}")
        finals = {key for key, held in self._finals.items() if any(name in names for name, _ in held)}
        keep_op, plan = self._schedule(finals, keep_draws=False)
        on_device = [device.index if device.index is not None else torch.accelerator.current_device_index()] \
            if device.type != "cpu" else []
        with torch.random.fork_rng(devices=on_device, device_type=device.type if on_device else "cuda"):
            yield from self._replay(finals, keep_op, plan, device, seed)

    def _replay(self, finals: set[int], keep_op: list[bool], plan: list[list[int]], device: torch.device,
                seed: int | None) -> Iterator[tuple[list[str], Tensor]]:
        host: dict[int, Tensor] = {key: s.constant.to(device) for key, s in self.storages.items()
                                   if s.constant is not None}
        with torch.no_grad():
            for i, op in enumerate(self.ops):
                if keep_op[i]:
                    if seed is not None and op.random:
                        torch.manual_seed(_draw_seed(seed, i))
                    self._run(op, host, device)
                for key in plan[i]:
                    if key in finals and self._last_use[key] == i:
                        yield self._final(key, host)
                    host.pop(key, None)
        for key in finals:  # constants no op touched
            if key in host:
                yield self._final(key, host)

    def _run(self, op: _Op, host: dict[int, Tensor], device: torch.device) -> None:
        for key in op.writes:
            if key not in host:  # its previous value was not needed: fresh memory to write into
                storage = self.storages[key]
                host[key] = torch.empty(storage.numel, dtype=storage.dtype, device=device)
        leaves = [host[a.key].as_strided(a.size, a.stride, a.offset) if isinstance(a, _View)
                  else device if isinstance(a, torch.device) and a.type == "cpu" else a
                  for a in op.flat_args]
        args, kwargs = tree_unflatten(leaves, op.spec)
        out = op.func(*args, **kwargs)
        out_flat, _ = tree_flatten(out)
        for j, key in op.made:
            host[key] = out_flat[j]

    def _final(self, key: int, host: dict[int, Tensor]) -> tuple[list[str], Tensor]:
        (_, view), names = self._finals[key][0], [name for name, _ in self._finals[key]]
        return names, host[key].as_strided(view.size, view.stride, view.offset)


def _draw_seed(seed: int, index: int) -> int:
    """The fast route's seed for the draw at position ``index`` of the build."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _touched(op: _Op) -> set[int]:
    return op.reads | op.writes | {k for _, k in op.made}


def _is_random(func) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments) or _base_name(func) in _RANDOM_WITHOUT_GENERATOR


def _base_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _on_host(value: Any) -> Any:
    """A recorded non-tensor argument, for the replay on the host (the build ran on the meta device)."""
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    return value


def _storage_numel(tensor: Tensor) -> int:
    return tensor.untyped_storage().nbytes() // tensor.dtype.itemsize


def _whole_storage(tensor: Tensor) -> Tensor:
    return tensor.as_strided((_storage_numel(tensor),), (1,), 0)
