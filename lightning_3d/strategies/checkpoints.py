"""Checkpoints for the strategy: sharded DCP directories (``lightning_3d.checkpoint``), resharded on load."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch import nn
from torch.optim import Optimizer

from lightning_3d.checkpoint import atomic, sharded
from lightning_3d.checkpoint.async_save import AsyncSaves
from lightning_3d.checkpoint.resumable import ResumableLoader
from lightning_3d.checkpoint.safe_load import torch_load
from lightning_3d.fused_parts import FusedParts, fused_layouts
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.strategies.faults import RunPhases

# Optimizer state keyed by parameter FQN, with param_groups flattened per FQN too: each pipeline stage's
# optimizer holds other parameters, and the flattened form is what lets any layout read any other's.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_IN_SHARDS = "in the checkpoint's DCP shards"  # what "optimizer_states" holds in a loaded sharded checkpoint


class ShardedCheckpoints:
    """Checkpoints for ``ThreeDStrategy``'s hooks. ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write a
    directory in which every rank writes only what it holds; ``fit(ckpt_path=...)`` loads one written at any
    layout (resharded), and a single-file Lightning checkpoint (e.g. from one device) loads too.

    Each method takes what it works on -- the module, its optimizers, this run's ``sharding`` (from
    :func:`sharding_of`) -- and runs inside the ``phases``' checkpoint phase (``strategies/faults.py``). It
    keeps between calls the random streams read from a checkpoint of this very sharding, until the strategy
    restores them (:meth:`take_rank_state`), and, with ``async_save``, the save still being written
    (``checkpoint/async_save.py``): every load and the end of the run (:meth:`finish`) wait for it."""

    def __init__(self, phases: RunPhases, async_save: bool = False) -> None:
        self.phases = phases
        self._rank_state_to_load: Optional[dict] = None
        self._async = AsyncSaves() if async_save else None
        self._failed = False

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """This rank's shards of the model's state, by single-device name: nothing is gathered."""
        return get_model_state_dict(module)

    def optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state, keyed by parameter name (readable at any layout)."""
        optimizer = _unwrapped(optimizer)  # unwrap Lightning's LightningOptimizer
        return get_optimizer_state_dict(module, optimizer, options=_OPTIM)

    def save(self, path: Path, checkpoint: dict[str, Any], sharding: dict[str, int], rank_state: dict[str, Any],
             module: nn.Module) -> None:
        """Write Lightning's ``checkpoint`` dict of ``module`` to directory ``path``. Collective."""
        state = {"model": checkpoint.pop("state_dict")}
        optimizers = checkpoint.pop("optimizer_states", None)
        if optimizers is not None:
            state.update({f"optimizer_{i}": s for i, s in enumerate(optimizers)})
            checkpoint["optimizer_states"] = [_IN_SHARDS] * len(optimizers)
        checkpoint["lightning_3d"] = {"layout": sharding, "world_size": dist.get_world_size()}
        with self.phases.phase("checkpoint save", "checkpoint_timeout"):
            if self._async is not None:
                self._async.save(path, state, checkpoint, rank_state, fused_layouts(module))  # while training goes on
            else:
                sharded.save(path, state, checkpoint, rank_state, fused_layouts(module))

    def remove(self, path: Path) -> None:
        """Rank 0. With asynchronous saves, once the pending one is committed: until then ``path`` may be the
        only whole checkpoint."""
        if self._async is not None:
            self._async.after_pending(lambda: atomic.remove(path))
            return
        with self.phases.phase("checkpoint removal", "checkpoint_timeout"):
            atomic.remove(path)

    def on_failure(self) -> None:
        """The run is ending on an error: :meth:`finish` reports a pending save that fails, not raises."""
        self._failed = True

    def finish(self) -> None:
        """At the end of the run: the pending asynchronous save is committed when this returns."""
        if self._async is not None:
            with self.phases.phase("checkpoint save: waiting for the asynchronous write", "checkpoint_timeout"):
                self._async.close(failed=self._failed)
        self._failed = False

    def load(self, path: Path, module: pl.LightningModule, optimizers: list[Optimizer], sharding: dict[str, int],
             weights_only: Optional[bool], barrier: Callable[[str], None]) -> dict[str, Any]:
        """Lightning's checkpoint dict from ``path``; a sharded one fills the module (and, when fitting, the
        optimizers) here, resharded from the sharding it was written at. Collective."""
        with self.phases.phase("checkpoint load", "checkpoint_timeout"):
            if self._async is not None:
                self._async.wait(f"loading {path}")  # it may be the very checkpoint to load
            if path.is_file():
                if weights_only is False:  # the user vouched for the file: Lightning's documented opt-out
                    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
                return torch_load(path, what="the checkpoint", opt_out=sharded.TRUSTED_HINT, map_location="cpu",
                                  mmap=True)
            return self._load_sharded(path, module, optimizers, sharding, weights_only, barrier)

    def _load_sharded(self, path: Path, module: pl.LightningModule, optimizers: list[Optimizer],
                      sharding: dict[str, int], weights_only: Optional[bool],
                      barrier: Callable[[str], None]) -> dict[str, Any]:
        if dist.get_rank() == 0:
            atomic.recover(path)
        barrier("lightning_3d.recover_checkpoint")
        meta = sharded.read_meta(path, trusted=weights_only is False)
        written = meta["lightning_3d"]
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        optimizers = [_unwrapped(o) for o in optimizers]  # unwrap Lightning's LightningOptimizer
        if fitting and meta.get("optimizer_states"):
            state.update({f"optimizer_{i}": get_optimizer_state_dict(module, o, options=_OPTIM)
                          for i, o in enumerate(optimizers)})
        model_keys = [None] * dist.get_world_size()
        dist.all_gather_object(model_keys, [f"model.{k}" for k in state["model"]])
        sharded.check_matches(path, state, {k for keys in model_keys for k in keys}, module.strict_loading,
                              written_by=_describe(written["layout"]), layouts=fused_layouts(module))
        sharded.load(path, state, fused_layouts(module))
        set_model_state_dict(module, state["model"])
        for i, optimizer in enumerate(optimizers if len(state) > 1 else []):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=_OPTIM)
        if written["layout"] == sharding and written["world_size"] == dist.get_world_size():
            self._rank_state_to_load = sharded.read_rank_state(path, dist.get_rank())  # see take_rank_state
        else:
            rank_zero_info(f"lightning_3d: resharded {path} from {_describe(written['layout'])} to"
                           f" {_describe(sharding)}; random generators start afresh (their streams belong to the"
                           " old layout)")
        return meta

    def load_full_model(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
        """A single-file checkpoint's full tensors, redistributed to this layout: each rank takes the entries
        it holds (a pipeline stage holds some), and ``strict`` checks the names over all ranks. Collective."""
        held = set(module.state_dict())
        with self.phases.phase("checkpoint load", "checkpoint_timeout"):
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sorted(held))  # names only: strings, no tensor
            anywhere = {name for names in everyone for name in names}
            unexpected, missing = sorted(set(state_dict) - anywhere), sorted(held - set(state_dict))
            if strict and (unexpected or missing):
                raise RuntimeError(f"The single-file checkpoint does not match {type(module).__name__}: no rank"
                                   f" holds {unexpected or 'nothing'} of it, and it lacks {missing or 'nothing'}"
                                   " of what this rank holds. Pass strict loading off"
                                   " (LightningModule.strict_loading = False) to load what matches.")
            mine = _stored({name: value for name, value in state_dict.items() if name in held}, fused_layouts(module))
            set_model_state_dict(module, mine, options=StateDictOptions(full_state_dict=True, strict=strict))

    def load_full_optimizers(self, module: nn.Module, optimizers: list[Optimizer], states: list[Any],
                             saved_names: list[str]) -> None:
        """Optimizer states of a single-file checkpoint (sharded ones were loaded with the model in load).
        ``saved_names``: the checkpoint's model entries in the order they were saved. Collective."""
        for optimizer, state in zip(optimizers, states):
            if state != _IN_SHARDS:
                optimizer = _unwrapped(optimizer)
                with self.phases.phase("checkpoint load", "checkpoint_timeout"):
                    by_name = _keyed_by_name(state, module, optimizer, saved_names)
                    layouts = fused_layouts(module)
                    by_name = {**by_name, "state": {name: _stored(values, dict.fromkeys(values, layouts[name]))
                                                    if name in layouts else values
                                                    for name, values in by_name["state"].items()}}
                    set_optimizer_state_dict(module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

    def take_rank_state(self) -> Optional[dict[str, Any]]:
        """The random streams a checkpoint of this sharding held for this rank, once; else None."""
        state, self._rank_state_to_load = self._rank_state_to_load, None
        return state


def sharding_of(dims: ParallelDims, config: ParallelConfig) -> dict[str, int]:
    """How a run cuts its state: written into each checkpoint, so a load can tell whether it reshards."""
    return {"dp": dims.dp, "pp": dims.pp, "tp": dims.tp, "virtual_pipeline_size": config.virtual_pipeline_size,
            "zero_stage": config.zero_stage}


def resumable(dataloader: object, trainer: pl.Trainer, phases: RunPhases) -> object:
    """The training ``dataloader``, made to skip the batches of the epoch a resumed checkpoint had done
    (``checkpoint/resumable.py``); other loaders, and those that resume themselves, unchanged."""
    if trainer.state.stage != RunningStage.TRAINING or hasattr(dataloader, "load_state_dict"):
        return dataloader

    def batches_done() -> int:
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return done if done < trainer.num_training_batches else 0  # a finished epoch: the next starts afresh

    epoch = lambda: trainer.fit_loop.epoch_progress.current.processed  # the epoch Lightning's set_epoch gives
    return ResumableLoader(dataloader, batches_done, epoch=epoch,
                           skipping=lambda: phases.phase("set-up: skipping to the resume point", "setup_timeout"))


def _keyed_by_name(state: dict[str, Any], module: torch.nn.Module, optimizer: Optimizer,
                   saved_names: list[str]) -> dict[str, Any]:
    """``state`` with parameters keyed by name, as torch's distributed state-dict functions read it, holding
    the parameters this rank's ``optimizer`` holds.

    ``optimizer.state_dict()`` -- what Lightning saves under one device or DDP -- keys each parameter by its
    position in the optimizer's param groups. The optimizer built here by the same ``configure_optimizers``
    holds the same parameters in the same order, group for group -- under pipeline parallelism each rank
    the part its stages hold. So the names of a group are those every rank of this pipeline holds in it, in
    the order the checkpoint saved the model (the order ``parameters()`` gives them); collective over the world."""
    positions = [p for group in state["param_groups"] for p in group["params"]]
    if all(isinstance(p, str) for p in positions):
        return state
    names = {param: name for name, param in module.named_parameters()}
    held = [[names[p] for p in group["params"]] for group in optimizer.param_groups]
    everyone = [held]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held)  # names only: strings, no tensor
    order = {name: i for i, name in enumerate(saved_names)}
    groups = [sorted({n for rank in everyone for n in rank[g]}, key=lambda n: order.get(n, len(order)))
              for g in range(len(held))]
    saved = [len(group["params"]) for group in state["param_groups"]]
    if saved != [len(g) for g in groups] or any(n not in order for g in groups for n in g):
        raise ValueError(
            f"This single-file checkpoint's optimizer state names parameters by position, as torch's"
            f" optimizer.state_dict() does: the process that saved it held {saved} parameters per param group,"
            f" the ranks here hold {[len(g) for g in groups]}, so they cannot be matched (different models, or"
            " param groups that configure_optimizers builds differently per layout). Start from the weights"
            " only (ThreeDStrategy(init_from=...)), or resume at the layout that saved it.")
    mine = set(names.values())
    name_of = {position: name for group, full in zip(state["param_groups"], groups)
               for position, name in zip(group["params"], full)}
    return {"state": {name_of[position]: value for position, value in state["state"].items()
                      if name_of[position] in mine},
            "param_groups": [{**group, "params": [name_of[p] for p in group["params"] if name_of[p] in mine]}
                             for group in state["param_groups"]]}


def _stored(state: dict[str, Any], layouts: dict[str, FusedParts]) -> dict[str, Any]:
    """Full single-device tensors in the order this run stores them (``lightning_3d.fused_parts``): torch's
    state-dict functions cut a full tensor as its placements say."""
    return {name: layouts[name].stored(value) if name in layouts and torch.is_tensor(value) and value.ndim else value
            for name, value in state.items()}


def _describe(layout: dict[str, int]) -> str:
    return f"(dp, pp, tp) = ({layout['dp']}, {layout['pp']}, {layout['tp']}), zero_stage={layout['zero_stage']}"


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper, or ``optimizer`` itself."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
