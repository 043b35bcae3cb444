"""Sharded checkpoints: one directory written by every rank with PyTorch's Distributed Checkpoint (DCP).

Layout of a checkpoint directory::

    NAME.ckpt/
      .metadata, __*_*.distcp    DCP: every tensor under its single-device name, each rank writing the shards
                                 it holds; a tensor replicated over dp ranks is written once (DCP's dedup)
      lightning_3d.meta.pt       rank 0: Lightning's loops, schedulers, callbacks, hyper-parameters, and the
                                 layout the checkpoint was written with
      rng/rank{N}.pt             each rank's random generators (restored only on the same layout)

The DCP state is ``{"model": model state, "optimizer_0": flattened optimizer state, ...}``: because names
are the single-device FQNs (DESIGN.md) and DCP stores global shapes with shard offsets, any layout reads
exactly the slices it holds -- resharding is a load at another layout. Writing goes through
``lightning_3d.checkpoint.atomic``: a directory is complete or absent.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_3d.checkpoint import atomic
from lightning_3d.checkpoint.boxes import BoxesLoadPlanner, BoxesSavePlanner, single_device_size
from lightning_3d.checkpoint.safe_load import CheckedReader, torch_load
from lightning_3d.errors import CheckpointError
from lightning_3d.fused_parts import FusedParts, layout_of

FORMAT = "lightning_3d.dcp/1"
META_FILE = "lightning_3d.meta.pt"
RNG_DIR = "rng"
TRUSTED_HINT = " (or, to run its code, pass weights_only=False to trainer.fit)"


def save(path: Path, state: dict[str, Any], meta: dict[str, Any], rank_state: dict[str, Any],
         layouts: dict[str, FusedParts] | None = None) -> None:
    """Write ``state`` (tensors, sharded or not) with DCP, ``meta`` from rank 0 and ``rank_state`` from every
    rank, atomically, to ``path``; ``layouts``: the parameters stored in rank order
    (``lightning_3d.fused_parts.fused_layouts``), written in single-device order. Collective: every rank of the
    default process group calls it. (``checkpoint/async_save.py`` writes the same directory while training
    goes on.)"""
    partial = begin(path)
    dcp.save(state, storage_writer=writer(partial), planner=BoxesSavePlanner(layouts))
    write_small_files(partial, meta, rank_state)
    dist.barrier()  # every rank's files are on disk
    if dist.get_rank() == 0:
        atomic.commit(path)
    dist.barrier()


def begin(path: Path) -> Path:
    """The empty temporary directory of ``path`` (``atomic.start``), made by rank 0 and seen by every rank on
    return. Collective over the default process group."""
    partial = atomic.partial_path(path)
    if dist.get_rank() == 0:
        atomic.start(path)
        (partial / RNG_DIR).mkdir()
    dist.barrier()
    return partial


def writer(partial: Path) -> FileSystemWriter:
    """DCP's writer into the temporary directory: every file fsynced before the save returns (and before
    a commit can rename the directory)."""
    return FileSystemWriter(partial, sync_files=True)


def write_small_files(partial: Path, meta: dict[str, Any], rank_state: dict[str, Any]) -> None:
    """This rank's random streams and, on rank 0, Lightning's ``meta``, into the temporary directory, on disk
    when it returns. Tensors in them are written from host copies: nothing device-side is pickled."""
    rank = dist.get_rank()
    atomic.write_synced(_dumps(rank_state), partial / RNG_DIR / f"rank{rank}.pt")
    if rank == 0:
        atomic.write_synced(_dumps({**meta, "format": FORMAT}), partial / META_FILE)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).exists()


def check_complete(path: Path) -> None:
    if not path.exists():
        # A link to a save that never completed: ModelCheckpoint(save_last="link") links last.ckpt to the
        # step's checkpoint as soon as its save returns, which under async_checkpoint is before the commit.
        target = path.parent / os.readlink(path) if path.is_symlink() else path
        linked = f" (a link to {target}, which does not exist)" if target != path else ""
        unfinished = atomic.partial_path(target)
        hint = f"; an unfinished save is at {unfinished}: it was never completed and is never loaded" \
            if unfinished.exists() else ""
        raise FileNotFoundError(f"No checkpoint at {path}{linked}{hint}. Resume from an earlier checkpoint.")
    missing = [name for name in (".metadata", META_FILE) if not (path / name).exists()]
    if missing:
        raise CheckpointError(f"{path} is not a complete lightning_3d checkpoint: {', '.join(missing)} missing."
                              " Load a checkpoint directory that lightning_3d wrote, or a single-file checkpoint.")


def read_meta(path: Path, trusted: bool = False) -> dict[str, Any]:
    """Rank 0's Lightning state. Unpickled with code allowed to run only if ``trusted`` (the user passed
    ``weights_only=False``); else only plain values and our own types (``safe_load``)."""
    check_complete(path)
    if trusted:
        return torch.load(path / META_FILE, weights_only=False)
    return torch_load(path / META_FILE, what="the checkpoint's metadata", opt_out=TRUSTED_HINT)


def read_rank_state(path: Path, rank: int) -> dict[str, Any]:
    return torch_load(path / RNG_DIR / f"rank{rank}.pt", what="the checkpoint's random-generator state")


def stored_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Every entry of the checkpoint by flattened name: the global shape of a tensor, None for other values."""
    entries = CheckedReader(path).read_metadata().state_dict_metadata
    return {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None for k, v in entries.items()}


def check_matches(path: Path, state: dict[str, Any], model_keys_everywhere: set[str] | None, strict: bool,
                  written_by: str, layouts: dict[str, FusedParts] | None = None) -> None:
    """Raise, naming the first offending key, if ``state`` (this rank's template) asks for an entry the
    checkpoint lacks or has with another shape (its single-device shape: ``layouts`` as for :func:`save`);
    with ``strict``, also if the checkpoint has model entries that no rank's model has
    (``model_keys_everywhere``: the model's keys gathered over all ranks)."""
    stored = stored_shapes(path)
    for key, value in flatten(state).items():
        if key not in stored:
            raise CheckpointError(f"{key} is not in the checkpoint {path} (written by {written_by}). Is it a"
                                  " checkpoint of another model or config?")
        parts = layout_of(key, layouts or {}) if isinstance(value, DTensor) else None
        shape = (tuple(single_device_size(value, parts)) if isinstance(value, DTensor)
                 else tuple(value.shape) if isinstance(value, torch.Tensor) else None)
        if shape != stored[key] and not (shape is None and stored[key] is None):
            raise CheckpointError(f"{key} has shape {stored[key]} in the checkpoint {path} but {shape} in the"
                                  f" model (checkpoint written by {written_by}): a checkpoint of another model"
                                  " or config.")
    if strict and model_keys_everywhere is not None:
        unexpected = sorted(k for k in stored if k.startswith("model.") and k not in model_keys_everywhere)
        if unexpected:
            raise CheckpointError(f"The checkpoint {path} has {len(unexpected)} model entries the model does not"
                                  f" have, first {unexpected[0]} (shape {stored[unexpected[0]]}). Load into the"
                                  " model it was written from, or set strict_loading=False on the module.")


def load(path: Path, state: dict[str, Any], layouts: dict[str, FusedParts] | None = None) -> None:
    """Fill ``state`` (this rank's tensors, in their current layout; ``layouts`` as for :func:`save`) in place
    from the checkpoint. Collective."""
    dcp.load(state, storage_reader=CheckedReader(path), planner=BoxesLoadPlanner(layouts))


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to DCP's flattened names ("model.blocks.0.attn.weight")."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(apply_to_collection(obj, torch.Tensor, lambda t: t.detach().cpu()), buffer)
    return buffer.getvalue()
