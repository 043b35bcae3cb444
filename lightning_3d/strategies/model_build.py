"""The model's build in ``configure_model()`` under the strategy, and the verdict on how to initialize it."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_3d.parallel.init_record import ConstructionRecord, ModuleAttributes
from lightning_3d.parallel.init_tape import InitTape, OnMeta
from lightning_3d.parallel.memory import host_memory_available
from lightning_3d.parallel.parallelize import InitialWeights
from lightning_3d.parallel.weight_init import HostBuild, InitError, WeightSource, is_on_meta
from lightning_3d.policies.base import Plan


class WatchedBuild:
    """A model built inside :meth:`context` goes on the meta device unless the user asked for an exact build
    (``model_init="exact"``, or Lightning's ``empty_init=False``); the host random state it starts from is
    kept, and the build is watched (``parallel.init_record.ConstructionRecord``). :meth:`verdict` then uses
    the meta route only where replaying the init is proven to give the weights the model was written to
    have, and otherwise builds it again, as written, on the host (or refuses under ``model_init="meta"``).

    Example (what ``ThreeDStrategy`` does)::

        build = WatchedBuild("auto")
        with build.context(module, precision_plugin):
            module.configure_model()                 # Lightning calls it
        plan, weights = build.verdict(module, plan_for, precision_plugin, params_loaded=False)
    """

    def __init__(self, model_init: str) -> None:
        self.model_init = model_init
        self._rng_state: Optional[torch.Tensor] = None
        self._record: Optional[ConstructionRecord] = None
        self._before: Optional[ModuleAttributes] = None  # the LightningModule before configure_model()

    @contextmanager
    def context(self, module: Optional[pl.LightningModule], precision: Precision,
                empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        on_meta = self.model_init != "exact" and empty_init is not False
        self._rng_state = torch.get_rng_state()
        self._record = ConstructionRecord() if on_meta else None
        self._before = ModuleAttributes(module) if on_meta and module is not None else None
        with (torch.device("meta") if on_meta else nullcontext(), precision.tensor_init_context(),
              self._record or nullcontext()):
            yield

    def verdict(self, module: pl.LightningModule, plan_for: Callable[[pl.LightningModule], Plan],
                precision: Precision, params_loaded: bool, local_ranks: int = 1) -> tuple[Plan, InitialWeights]:
        """The plan for the module as it will be parallelized, and where its initial weights come from.
        ``local_ranks``: the ranks on this host, each of which may build the whole model on it (the host check)."""
        plan = plan_for(module)
        record, self._record = self._record, None
        metrics = _metrics_on_meta(module)
        if record is None or not (is_on_meta(module) or metrics):
            return plan, InitialWeights(self._rng_state)
        if self.model_init == "fast" and metrics is None:
            tape = self._record_build(module, precision)
            if tape.problem is None:
                return plan, InitialWeights(self._rng_state, seeded=tape)
            rank_zero_info(f"lightning_3d: model_init='fast' cannot replay the recorded build ({tape.problem});"
                           " taking model_init='auto' instead")
        why = metrics or record.verdict(module, plan.init_module, params_loaded=params_loaded)
        if why is None:
            return plan, InitialWeights(self._rng_state, record.reset_order(module))
        source = self._build_as_written(module, precision, why, on_every_rank=metrics is not None,
                                        local_ranks=local_ranks)
        if metrics is not None:  # the host build is the module now: exact, broadcast from rank 0
            return plan_for(module), InitialWeights(self._rng_state)
        return plan, InitialWeights(self._rng_state, streamed=True, source=source)

    def _build_as_written(self, module: pl.LightningModule, precision: Precision, why: str,
                          on_every_rank: bool, local_ranks: int) -> WeightSource | None:
        """Replaying the init on the meta build would not give the model's own weights (``why``): refuse under
        model_init="meta"; under "auto", global rank 0 runs configure_model() again, as written, from the
        attributes and random state it started with (the exact route), and keeps what it built aside as the
        source its weights stream from (``parallel.weight_init.stream_from_rank0``). That build is recorded on
        the meta device and replayed op by op on the host (``parallel.init_tape``), holding only the tensors
        being initialized; where the record cannot be replayed, it is built for real on the host. Every rank,
        rank 0 included, goes on with the meta build: no rank holds the whole model. Returns the source on
        rank 0, None elsewhere.

        ``on_every_rank``: every rank builds on the host and keeps that build (rank 0's weights are then
        broadcast), for what cannot be streamed -- a torchmetrics state made in configure_model(). Returns None."""
        fix = ("Give the modules a reset_parameters() that initializes their own tensors, or use"
               " model_init='auto' (builds on the host as written when replay cannot) or 'exact'.")
        if self.model_init == "meta" or self._before is None:
            raise InitError(f"model_init={self.model_init!r} builds the model on the meta device and replays each"
                            f" module's reset_parameters(), which would give other weights than the model as"
                            f" written: {why}. {fix}")
        rank_zero_info(f"lightning_3d: model_init='auto' builds the model as written (exact, on global rank 0,"
                       f" streamed to every rank's shards), since replaying its init module by module would give"
                       f" other weights: {why}")
        if not on_every_rank and dist.is_initialized() and dist.get_rank() != 0:
            return None
        built = ModuleAttributes(module)  # the meta build, which every rank parallelizes
        if not on_every_rank:
            tape = self._record_build(module, precision)
            if tape.problem is None:
                _check_host_memory(tape.peak_bytes, "replaying the recorded build op by op holds", module)
                return tape
            rank_zero_info(f"lightning_3d: the recorded build cannot be replayed ({tape.problem}); building the"
                           " whole model on global rank 0's host instead")
        _check_host_memory(_bytes_of(module) * (local_ranks if on_every_rank else 1),
                           "building the whole model on the host takes", module)
        self._before.restore(module)
        torch.set_rng_state(self._rng_state)
        with precision.module_init_context():
            module.configure_model()
        if is_on_meta(module):
            raise InitError(f"{type(module).__name__}.configure_model() built nothing new when called again from"
                            " the state it started in, so the model stays on the meta device. Use"
                            " model_init='exact', or give the modules reset_parameters() (see"
                            " lightning_3d.parallel.weight_init).")
        if on_every_rank:
            return None
        source = HostBuild(nn.ModuleDict(dict(module.named_children())))
        built.restore(module)
        return source

    def _record_build(self, module: pl.LightningModule, precision: Precision) -> InitTape:
        """configure_model() run again from where it started, on the meta device, under an :class:`InitTape`;
        ``module`` keeps the meta build it had (which every rank parallelizes)."""
        built = ModuleAttributes(module)
        self._before.restore(module)
        tape = InitTape(self._rng_state)
        with precision.module_init_context(), OnMeta(), tape:
            module.configure_model()
        tape.finish(nn.ModuleDict(dict(module.named_children())))
        built.restore(module)
        return tape


def _bytes_of(module: nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _check_host_memory(need: int, doing: str, module: nn.Module) -> None:
    """Refuse, before allocating, a host build that the host's available memory cannot hold."""
    available = host_memory_available()
    if available is None or need <= available:
        return
    raise InitError(f"lightning_3d: {doing} {need / 2**30:.2f} GiB of host memory, and this host has"
                    f" {available / 2**30:.2f} GiB available (the model: {_bytes_of(module) / 2**30:.2f} GiB)."
                    " Load the weights instead (ThreeDStrategy(init_from=...)), or give the modules a"
                    " reset_parameters() that initializes their own tensors, so the init replays on each rank's"
                    " shards (model_init='auto' or 'meta').")


def _metrics_on_meta(module: pl.LightningModule) -> str | None:
    """Why a torchmetrics ``Metric`` made in ``configure_model()`` cannot stay on the meta build: its state
    (counts starting at zero, a running max starting at -inf) has no values there, and no
    ``reset_parameters()`` to replay. None if there is none such."""
    from torchmetrics import Metric  # a dependency of Lightning's: always there

    def on_meta(metric: Metric) -> bool:  # a state is a tensor, or a list of them ("cat" states)
        states = [t for v in metric.metric_state.values() for t in (v if isinstance(v, list) else [v])]
        return any(isinstance(t, torch.Tensor) and t.is_meta for t in states)

    found = [f"{fqn} ({type(m).__name__})" for fqn, m in module.named_modules() if isinstance(m, Metric) and on_meta(m)]
    if not found:
        return None
    return (f"the torchmetrics state of {', '.join(found)} was made on the meta device and has no values there"
            " (make metrics in __init__ to keep the meta route)")
