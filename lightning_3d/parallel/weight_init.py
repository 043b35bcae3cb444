"""Layout-independent initialization: with one seed, every layout starts from the same full weights.

Three ways there (``ParallelConfig.model_init``):

* **exact** -- the model as the user wrote it. Built in ``configure_model()`` under ``model_init="auto"``
  (when its init cannot be replayed module by module): only global rank 0 builds it again, as written --
  recorded on the meta device and replayed op by op on the host (``parallel.init_tape``), so it holds only
  the tensors being initialized -- and every rank goes on with the meta build; :func:`stream_from_rank0`
  fills each rank's shards from rank 0's replay one full tensor at a time, so no rank ever holds the whole
  model. (Where the record cannot be replayed, rank 0 builds the whole model on the host instead:
  :class:`HostBuild`.) Built in ``__init__``, or with ``model_init="exact"`` (every rank holds it already):
  rank 0's weights are broadcast to every rank, as ``DistributedDataParallel`` does, then each rank keeps its
  shard. Any model, including ones whose init runs after construction (Hugging Face ``post_init``).
* **meta** -- the model was built on the meta device (no memory, no random numbers drawn). After it is
  split and sharded, :func:`replay_init` walks the *unsharded* skeleton in construction order and, module by
  module, draws each module's full parameters on the host by calling its ``reset_parameters()`` from the same
  random state that construction started from, then keeps only this rank's slice. At most one module's full
  tensors exist at a time. Every rank draws every module (even those on other pipeline stages) so the random
  stream, and the state it is left in, are the same on every rank and equal an eager build's.

* **fast** (``model_init="fast"``, opt-in, for the largest models) -- every rank records the build on the meta
  device (``parallel.init_tape``) and :func:`fill_seeded` replays only the ops that make its own tensors, on
  its own device, each random draw seeded apart (from the seed and the draw's place in the build). The
  model's own init code and distributions, the same weights at every layout and in one process under
  "fast", no collective -- but not the numbers the build as written draws from one stream.

The meta way is taken only where it is proven to give the eager build's weights: the build on the meta
device runs under a :class:`~lightning_3d.parallel.init_record.ConstructionRecord`, which watches every
write and random draw and says whether replaying the resets, in the order construction ran them, redraws
exactly those. Otherwise ``model_init="auto"`` builds the model again on the host as written (exact) and
says why; ``model_init="meta"`` refuses, naming the tensor and the line of code.

The meta way relies on one convention (PyTorch's own, used by FSDP's meta-device init): a module that owns
parameters or buffers initializes exactly those in ``reset_parameters()``, and an eager build calls it once
per module in construction order (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` and the reference GPT
do). A policy may supply ``Plan.init_module`` for modules without one (Hugging Face models: their
``_init_weights``). Modules that own tensors and have neither are named in an error before any weight is
used. With ``init_from`` the parameters come from the file: modules without ``reset_parameters()`` are then
initialized only if they own buffers (rotary frequencies), and need no ``init_module`` otherwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.checkpoint.boxes import local_boxes
from lightning_3d.common import named_tensors
from lightning_3d.errors import InitError
from lightning_3d.fused_parts import FusedParts, fused_layouts

if TYPE_CHECKING:
    from lightning_3d.parallel.init_tape import InitTape

InitModule = Callable[[nn.Module], None]
"""Initializes one module's own parameters and buffers in place (``Plan.init_module``)."""


def is_on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built (at least in part) on the meta device and awaits initialization."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate, uninitialized, the tensors of ``model`` that are on the meta device, and only those; a tensor
    that several modules hold (tied weights) stays one tensor.

    ``model.to_empty()`` would allocate every tensor anew, and so throw away what was built for real next to
    the meta model: a parameter made in ``__init__`` beside a model built in ``configure_model()``, or a
    torchmetrics ``Metric``'s state (which ``Metric._apply`` maps too, defaults included: its counts would
    then start from whatever the new memory held).
    """
    made: dict[int, Tensor] = {}  # id of a meta tensor -> what replaces it, for every module that holds it
    for fqn, module in model.named_modules():
        own = _own_tensors(module)
        if not any(t.is_meta for t in own.values()):
            continue
        real = [name for name, t in own.items() if not t.is_meta]
        if real:
            raise InitError(f"{fqn or '<root>'} ({type(module).__name__}) holds tensors on the meta device and"
                            f" real ones ({', '.join(real)}); build all of its tensors in configure_model(), or"
                            " pass ThreeDStrategy(model_init='exact').")
        for name, tensor in own.items():
            if id(tensor) not in made:
                empty = torch.empty_like(tensor, device=device)
                made[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else empty)
            setattr(module, name, made[id(tensor)])


def modules_without_reset(model: nn.Module, init_module: InitModule | None = None,
                          params_loaded: bool = False) -> list[str]:
    """FQNs of modules that own parameters or buffers but have no ``reset_parameters()`` to replay (nor an
    ``init_module`` that takes them); with ``params_loaded``, only modules owning buffers count."""
    return [
        fqn or "<root>"
        for fqn, module in model.named_modules()
        if _to_replay(module, params_loaded) and _reset(module, init_module) is None
    ]


def check_replayable(model: nn.Module, init_module: InitModule | None = None, params_loaded: bool = False) -> None:
    """Raise before any weight is allocated if :func:`replay_init` cannot initialize ``model``."""
    missing = modules_without_reset(model, init_module, params_loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise InitError(
            f"model_init='meta' replays each module's reset_parameters(), but these modules own parameters or"
            f" buffers and have none: {shown}. Give them a reset_parameters() that initializes their own"
            " tensors, or pass ThreeDStrategy(model_init='exact') to build the model on the host as written."
        )


def replay_init(skeleton: nn.Module, model: nn.Module, rng_state: Tensor, init_module: InitModule | None = None,
                params_loaded: bool = False, order: list[str] | None = None) -> None:
    """Initialize the materialized (possibly split and sharded) ``model`` from the meta ``skeleton``.

    ``skeleton`` is the unsharded model on the meta device with the same FQNs; it is used as scratch space
    (one module's tensors at a time) and left on meta. ``rng_state`` is the host random state construction
    started from; the host generator ends in the state an eager build would leave it in. ``init_module``
    initializes the modules without ``reset_parameters()`` (``Plan.init_module``). ``params_loaded``: the
    parameters come from a file next (``init_from``), so of those modules only ones owning buffers are
    initialized. ``order``: the FQNs of the modules in the order construction reset them
    (``ConstructionRecord.reset_order``; a module reset twice is replayed twice); the modules it leaves out,
    or all without it, follow in ``named_modules()`` order.
    """
    targets = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    layouts = fused_layouts(model)
    # A tied tensor goes to each of its names this rank holds (the embedding on the first pipeline stage, the
    # head on the last): the last module to reset it wins, as in an eager build, on every stage alike.
    names: dict[int, list[str]] = {}
    for fqn, tensor in [*skeleton.named_parameters(remove_duplicate=False), *skeleton.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(fqn)
    torch.set_rng_state(rng_state)
    with torch.no_grad():
        for prefix, module in _replay_order(skeleton, order or []):
            own = _own_tensors(module)
            if not _to_replay(module, params_loaded):
                continue
            for name, tensor in own.items():
                _set_tensor(module, name, torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"))
            _reset(module, init_module)()
            for name, meta in own.items():
                for fqn in names.get(id(meta), [f"{prefix}.{name}" if prefix else name]):
                    target = targets.get(fqn)
                    if target is not None:  # None: it lives on another pipeline stage
                        _copy_slice(getattr(module, name), target, layouts.get(fqn))
                _set_tensor(module, name, meta)


def _replay_order(skeleton: nn.Module, order: list[str]) -> list[tuple[str, nn.Module]]:
    modules = dict(skeleton.named_modules())
    recorded = [(fqn, modules[fqn]) for fqn in order if fqn in modules]
    listed = set(order)
    return recorded + [(fqn, m) for fqn, m in modules.items() if fqn not in listed]


class WeightSource(Protocol):
    """Global rank 0's initial weights, handed out tensor by tensor: a host build (:class:`HostBuild`) or a
    recorded build replayed op by op (``parallel.init_tape.InitTape``)."""

    def order(self) -> list[list[str]]:
        """Every parameter and buffer name, grouped by tensor (tied ones together), in :meth:`tensors`' order."""

    def tensors(self) -> Iterator[tuple[list[str], Tensor]]:
        """Each group's names and its full tensor, in :meth:`order`."""


class HostBuild:
    """A :class:`WeightSource` over a model built for real on the host (the whole model, held until the end)."""

    def __init__(self, model: nn.Module) -> None:
        self._groups: dict[int, tuple[list[str], Tensor]] = {}
        for name, tensor in named_tensors(model).items():
            self._groups.setdefault(id(tensor), ([], tensor))[0].append(name)

    def order(self) -> list[list[str]]:
        return [names for names, _ in self._groups.values()]

    def tensors(self) -> Iterator[tuple[list[str], Tensor]]:
        yield from self._groups.values()


def stream_from_rank0(skeleton: nn.Module, model: nn.Module, source: WeightSource | None,
                      device: torch.device) -> None:
    """Fill the materialized (split, sharded) ``model`` with global rank 0's initial weights ``source``, one
    full tensor at a time: rank 0 broadcasts each on ``device`` and every rank keeps its slice of it
    (collective; ``source`` is None on the other ranks).

    ``skeleton`` is the unsharded model on the meta device, with ``source``'s names. Rank 0 first sends the
    order its tensors come in (names only), then each tensor. So a rank holds its shards plus one full
    tensor in flight, and rank 0 also what ``source`` holds: the whole model for a :class:`HostBuild` (as
    ``set_model_state_dict(..., broadcast_from_rank0=True)``), the tensors being initialized for a replay.
    """
    targets, metas, layouts = named_tensors(model), named_tensors(skeleton), fused_layouts(model)
    order = _order_from_rank0(source)
    streamed = {name for names in order for name in names}
    if streamed != set(metas):  # the same on every rank: raised before any tensor is sent
        missing, extra = sorted(set(metas) - streamed), sorted(streamed - set(metas))
        raise InitError(f"global rank 0's build of the model has other tensors than the meta build: missing"
                        f" {missing[:4]}, not in the model {extra[:4]}. configure_model() must build the same"
                        " model each time it is called; or pass ThreeDStrategy(model_init='exact').")
    tensors = source.tensors() if source is not None else None
    with torch.no_grad():
        for names in order:
            if tensors is not None:
                _, full = next(tensors)
                full = full.detach().to(device)
            else:
                full = torch.empty(metas[names[0]].shape, dtype=metas[names[0]].dtype, device=device)
            if dist.is_initialized():
                dist.broadcast(full, src=0)
            for name in names:
                target = targets.get(name)
                if target is not None:  # None: it lives on another pipeline stage
                    _copy_slice(full, target, layouts.get(name))
            del full
        for _ in tensors or ():  # a replay runs to its end, leaving the random state the build leaves
            pass


def fill_seeded(model: nn.Module, tape: InitTape, device: torch.device, seed: int) -> None:
    """Fill the materialized (split, sharded) ``model`` from the recorded build ``tape``, replayed on ``device``
    for this rank's tensors only, every draw seeded apart from ``seed`` (``InitTape.seeded_tensors``; no
    collective). A rank holds its shards plus one full tensor of its own stages at a time."""
    targets, layouts = named_tensors(model), fused_layouts(model)
    for names, full in tape.seeded_tensors(set(targets), device, seed):
        for name in names:
            if name in targets:
                _copy_slice(full, targets[name], layouts.get(name))


def seed_of(rng_state: bytes) -> int:
    """The fast route's seed: from the host random state the build started from (on global rank 0), so that
    ``seed_everything`` sets it and every rank agrees."""
    return int.from_bytes(hashlib.sha256(rng_state).digest()[:8], "little")


def _order_from_rank0(source: WeightSource | None) -> list[list[str]]:
    holder = [source.order() if source is not None else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def broadcast_from_rank0(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank's parameters and buffers equal global rank 0's (collective over ``group``)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0, group=group)


def _to_replay(module: nn.Module, params_loaded: bool) -> bool:
    """Whether replay initializes ``module``. Modules with ``reset_parameters()`` always are, so the random
    stream ends where an eager build leaves it (dropout then matches a run that built eagerly and loaded the
    file); with ``params_loaded``, the others only if they own buffers."""
    if params_loaded and not callable(getattr(module, "reset_parameters", None)):
        return bool(dict(module.named_buffers(recurse=False)))
    return bool(_own_tensors(module))


def _reset(module: nn.Module, init_module: InitModule | None) -> Callable[[], None] | None:
    """What initializes ``module``'s own tensors: its ``reset_parameters``, else ``init_module``, else None."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    return partial(init_module, module) if init_module is not None else None


def _own_tensors(module: nn.Module) -> dict[str, Tensor]:
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _set_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    """Swap one tensor of a skeleton module (ours: a scratch copy) keeping its kind, parameter or buffer."""
    current = getattr(module, name)
    if isinstance(current, nn.Parameter) and not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=current.requires_grad)
    setattr(module, name, value)


def _copy_slice(full: Tensor, target: Tensor, parts: FusedParts | None = None) -> None:
    """Copy the part of the full tensor that ``target`` (a plain tensor or a DTensor shard) holds. The full
    tensor is sliced where it lies and only the slices move: the host's draw of a whole weight never goes to
    the GPU (which ``distribute_tensor`` would do first). The slices are the boxes the checkpoints use
    (``checkpoint.boxes.local_boxes``), which follow FSDP2's layout of a dp cut over a tp split too (a fused
    q|k|v bias under ZeRO, sharded on the meta device before it is initialized) and map a fused projection
    stored in rank order (``parts``) to its single-device order."""
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    local = target.to_local()
    for offsets, sizes, region in local_boxes(target, parts):
        local[region].copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
