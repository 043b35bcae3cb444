"""Strategy hooks for checkpoints: sharded DCP directories (``lightning_3d.checkpoint``), resharded on load."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.checkpoint import atomic, sharded
from lightning_3d.checkpoint.resumable import ResumableLoader
from lightning_3d.checkpoint.safe_load import torch_load

# Optimizer state keyed by parameter FQN, with param_groups flattened per FQN too: each pipeline stage's
# optimizer holds other parameters, and the flattened form is what lets any layout read any other's.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_IN_SHARDS = "in the checkpoint's DCP shards"  # what "optimizer_states" holds in a loaded sharded checkpoint


class ShardedCheckpoints:
    """Mixed into ``ThreeDStrategy``. ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write a directory in
    which every rank writes only what it holds; ``fit(ckpt_path=...)`` loads one written at any layout.
    A single-file Lightning checkpoint (e.g. from one device) loads too."""

    # ------------------------------------------------------------------ save

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.lightning_module)  # this rank's shards: nothing is gathered

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=_OPTIM)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("ThreeDStrategy.save_checkpoint(storage_options=...) is not supported: checkpoints are"
                            " written with torch.distributed.checkpoint, not a CheckpointIO plugin.")
        path = Path(self.broadcast(str(filepath)))  # rank 0 names the directory every rank writes into
        state = {"model": checkpoint.pop("state_dict")}
        optimizers = checkpoint.pop("optimizer_states", None)
        if optimizers is not None:
            state.update({f"optimizer_{i}": s for i, s in enumerate(optimizers)})
            checkpoint["optimizer_states"] = [_IN_SHARDS] * len(optimizers)
        checkpoint["lightning_3d"] = {"layout": self._layout(), "world_size": self.world_size}
        with self._phase("checkpoint save", "checkpoint_timeout"):
            sharded.save(path, state, checkpoint, self._rank_state())

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            with self._phase("checkpoint removal", "checkpoint_timeout"):
                atomic.remove(Path(filepath))

    # ------------------------------------------------------------------ load

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with self._phase("checkpoint load", "checkpoint_timeout"):
            return self._load_checkpoint(checkpoint_path, weights_only)

    def _load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool]) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_file():
            if weights_only is False:  # the user vouched for the file: Lightning's documented opt-out
                return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            return torch_load(path, what="the checkpoint", opt_out=sharded.TRUSTED_HINT, map_location="cpu", mmap=True)
        if self.is_global_zero:
            atomic.recover(path)
        self.barrier("lightning_3d.recover_checkpoint")
        meta = sharded.read_meta(path, trusted=weights_only is False)
        written = meta["lightning_3d"]
        module, fitting = self.lightning_module, self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
        if fitting and meta.get("optimizer_states"):
            optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
            state.update({f"optimizer_{i}": get_optimizer_state_dict(module, o, options=_OPTIM)
                          for i, o in enumerate(optimizers)})
        model_keys = [None] * self.world_size
        dist.all_gather_object(model_keys, [f"model.{k}" for k in state["model"]])
        sharded.check_matches(path, state, {k for keys in model_keys for k in keys}, module.strict_loading,
                              written_by=_describe(written["layout"]))
        sharded.load(path, state)
        set_model_state_dict(module, state["model"])
        for i, optimizer in enumerate(self.optimizers if len(state) > 1 else []):
            set_optimizer_state_dict(module, getattr(optimizer, "_optimizer", optimizer), state[f"optimizer_{i}"],
                                     options=_OPTIM)
        if written["layout"] == self._layout() and written["world_size"] == self.world_size:
            self._rank_state_to_load = sharded.read_rank_state(path, self.global_rank)  # see on_train_start
        else:
            rank_zero_info(f"lightning_3d: resharded {path} from {_describe(written['layout'])} to {_describe(self._layout())};"
                           " random generators start afresh (their streams belong to the old layout)")
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # a single-file checkpoint: full tensors, redistributed to this layout
            options = StateDictOptions(full_state_dict=True, strict=strict)
            with self._phase("checkpoint load", "checkpoint_timeout"):
                set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if state != _IN_SHARDS:  # sharded ones were loaded with the model in load_checkpoint
                optimizer = getattr(optimizer, "_optimizer", optimizer)
                with self._phase("checkpoint load", "checkpoint_timeout"):
                    set_optimizer_state_dict(self.lightning_module, optimizer,
                                             _keyed_by_name(state, self.lightning_module, optimizer),
                                             options=StateDictOptions(full_state_dict=True))

    # ------------------------------------------------------------------ resuming mid-epoch

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or hasattr(dataloader, "load_state_dict"):
            return dataloader
        epoch = lambda: trainer.fit_loop.epoch_progress.current.processed  # the epoch Lightning's set_epoch gives
        return ResumableLoader(dataloader, self._batches_done, epoch=epoch,
                               skipping=lambda: self._phase("set-up: skipping to the resume point", "setup_timeout"))

    def _batches_done(self) -> int:
        trainer = self.lightning_module.trainer
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return done if done < trainer.num_training_batches else 0  # a finished epoch: the next starts afresh

    # ------------------------------------------------------------------ per-rank state

    @override
    def on_train_start(self) -> None:
        # Not in load_checkpoint: between the two, Lightning creates the epoch's data-loader iterator, which
        # draws from the generators, as it did before the saved steps in the interrupted run.
        if self._rank_state_to_load is not None:
            self._load_rank_state(self._rank_state_to_load)
            self._rank_state_to_load = None

    @override
    def on_train_end(self) -> None:
        self._rank_state_to_load = None  # from a load during training (NaNGuard's rollback): not a resume

    def _layout(self) -> dict[str, int]:
        dims, config = self.parallel_dims, self.parallel_config
        return {"dp": dims.dp, "pp": dims.pp, "tp": dims.tp, "virtual_pipeline_size": config.virtual_pipeline_size,
                "zero_stage": config.zero_stage}

    def _rank_state(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if self._sharded_rng is not None:
            state["sharded"] = self._sharded_rng.state_dict()
        try:
            import numpy

            state["numpy"] = numpy.random.get_state()
        except ImportError:
            pass
        return state

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if "sharded" in state and self._sharded_rng is not None:
            self._sharded_rng.load_state_dict(state["sharded"])
        if "numpy" in state:
            import numpy

            numpy.random.set_state(state["numpy"])


def _keyed_by_name(state: dict[str, Any], module: torch.nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``state`` with parameters keyed by name, as torch's distributed state-dict functions read it.

    ``optimizer.state_dict()`` -- what Lightning saves under one device or DDP -- keys each parameter by its
    position in the optimizer's param groups. The optimizer built here by the same ``configure_optimizers``
    holds the same parameters in the same order, group for group, unless pipeline stages split them over
    ranks: then positions cannot be matched, and the error says how to resume instead."""
    positions = [p for group in state["param_groups"] for p in group["params"]]
    if all(isinstance(p, str) for p in positions):
        return state
    saved = [len(group["params"]) for group in state["param_groups"]]
    held = [len(group["params"]) for group in optimizer.param_groups]
    if saved != held:
        raise ValueError(
            f"This single-file checkpoint's optimizer state names parameters by position, as torch's"
            f" optimizer.state_dict() does: the process that saved it held {saved} parameters per param group,"
            f" this rank's optimizer holds {held} (its pipeline stage's part), so they cannot be matched. Resume"
            f" once with pipeline_parallel_size=1 (any dp and tp) and save: ThreeDStrategy's sharded checkpoint"
            f" then loads at any layout. Or start from the weights only (ThreeDStrategy(init_from=...)).")
    names = {param: name for name, param in module.named_parameters()}
    name_of = {position: names[param] for group, ours in zip(state["param_groups"], optimizer.param_groups)
               for position, param in zip(group["params"], ours["params"])}
    return {"state": {name_of[position]: value for position, value in state["state"].items()},
            "param_groups": [{**group, "params": [name_of[p] for p in group["params"]]}
                             for group in state["param_groups"]]}


def _describe(layout: dict[str, int]) -> str:
    return f"(dp, pp, tp) = ({layout['dp']}, {layout['pp']}, {layout['tp']}), zero_stage={layout['zero_stage']}"
