"""Start from pretrained weights at any layout: every rank reads only the slices of the tensors it holds.

``ThreeDStrategy(init_from=PATH)``, once the model is parallelized (tp shards, pipeline stage, ZeRO shards)
and before training: for each tensor of this rank's state dict -- a DTensor shard or a whole tensor -- the
global region it holds (``checkpoint.boxes.local_boxes``: one box, or several for a strided shard) is read from
PATH and copied in. No rank reads, or holds in memory, more than its share plus the tensor being read.

PATH may be
* a safetensors file of any dtype the ``safetensors`` package reads (FP8 included), slice by slice from a
  memory map (``safetensors.safe_open(...).get_slice``, through ``safetensors_io.SafetensorsReader``);
* a directory of safetensors files with ``model.safetensors.index.json`` (the Hugging Face layout);
* a ``torch.save`` file of a state dict, or a Lightning ``.ckpt`` file (its ``state_dict``), loaded with
  ``mmap=True`` so only the slices read are paged in;
* a checkpoint directory of ours (DCP reads each rank's slices itself).

Names: a checkpoint's keys are either the LightningModule's (``model.tok_emb.weight``) or the inner
model's (``tok_emb.weight``, what ``lightning-3d convert --strip-prefix model.`` writes); the first that
covers every key of this rank is used. Other names come from the policy (``Plan.checkpoint_names``); a tied
weight stored once (``Plan.tied_parameters``) is read for both ends. A mixture of experts stored one expert
apart from another (Mixtral's ``experts.3.w1.weight``, what ``save_pretrained`` writes) is read as the stacked
tensors the model holds, by transformers' conversion mapping of its model type (``checkpoint.stacked_experts``).
A key the checkpoint lacks, a global shape that differs, or a dtype of another kind (integers for a float weight;
float formats convert), is an error naming the tensor, raised before anything is copied; so are a truncated file
and a half-written checkpoint directory.

Why not DCP's ``HuggingFaceStorageReader`` for a Hugging Face directory: it reads the same slices the same way
(``get_slice``) and gives the same weights in about the same CPU time, but it keeps each file's map open for the
whole load, so its peak memory grows by about twice as much; it reads directories only (not one file, a torch file or our checkpoints), takes no renames, and a tied weight
stored once (Hugging Face's way) needs a second load under the other name: more code around it, not less.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_3d.checkpoint import sharded
from lightning_3d.checkpoint.boxes import local_boxes, single_device_size
from lightning_3d.checkpoint.safe_load import torch_load
from lightning_3d.checkpoint.safetensors_io import SafetensorsReader
from lightning_3d.checkpoint.stacked_experts import conversions_of, stacked_names
from lightning_3d.fused_parts import fused_layouts

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # a Hugging Face directory of a model small enough for one file


class Source:
    """Tensors by name: their global shapes and dtypes, and ``copy_into(name, region, out)``:
    ``out.copy_(t[region])``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                 copy_into: Callable[[str, tuple[slice, ...], torch.Tensor], object]) -> None:
        self.shapes, self.dtypes, self.copy_into = shapes, dtypes, copy_into


def check_init_from(path: str) -> None:
    """Before any collective: the path exists and is a kind we read."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"init_from={path!r}: no such file or directory.")
    if p.name.startswith(".") and p.name.endswith(".partial"):
        raise ValueError(f"init_from={path!r} is a checkpoint still being written, or left half-written by a"
                         f" crash (lightning_3d.checkpoint.atomic); use the complete one, {p.name[1:-8]!r}.")
    if p.is_dir() and not any((p / name).exists() for name in (INDEX, SINGLE)) and not sharded.is_sharded_checkpoint(p):
        raise ValueError(f"init_from={path!r} is a directory without {INDEX}, {SINGLE} or a lightning_3d checkpoint's files:"
                         " give a safetensors file, a torch state-dict file, a Hugging Face safetensors directory"
                         " or a checkpoint directory written by lightning_3d.")


def load_pretrained(module: nn.Module, path: str, renames: dict[str, str] | None = None,
                    tied: list[tuple[str, str]] = ()) -> None:
    """Copy the weights at ``path`` into this rank's part of ``module`` (no communication, except for a
    checkpoint directory of ours, which DCP loads collectively). ``renames``: key prefix -> the checkpoint's.
    ``tied``: pairs of tied parameters (``Plan.tied_parameters``); a file may hold only the first of a pair,
    as Hugging Face saves tied weights once."""
    state = get_model_state_dict(module)  # this rank's tensors under single-device names; they alias the module's
    layouts = fused_layouts(module)
    p = Path(path)
    if sharded.is_sharded_checkpoint(p):
        sharded.check_matches(p, {"model": state}, None, strict=False, written_by="init_from", layouts=layouts)
        sharded.load(p, {"model": state}, layouts)
        return
    source = _open(p)
    partners = {second: first for first, second in tied}
    try:
        names = _names(list(state), source.shapes, path, renames or {}, partners)
    except KeyError:
        # each expert stored apart (a Hugging Face mixture of experts' own layout): read as the model's stacks
        stacked = stacked_names(source.shapes, source.dtypes, source.copy_into, conversions_of(module))
        if stacked is None:
            raise
        source = Source(*stacked)
        names = _names(list(state), source.shapes, path, renames or {}, partners)
    for key, tensor in state.items():
        name = names[key]
        shape = tuple(single_device_size(tensor, layouts.get(key)) if isinstance(tensor, DTensor) else tensor.shape)
        if shape != source.shapes[name]:
            raise ValueError(f"init_from={path!r}: {name} has shape {source.shapes[name]} there but {key} has"
                             f" {shape} in the model.")
        if _kind(source.dtypes[name]) != _kind(tensor.dtype):  # floats convert (bf16 file, fp32 model); kinds do not
            raise ValueError(f"init_from={path!r}: {name} is {source.dtypes[name]} there but {key} is {tensor.dtype}"
                             f" in the model; a {_kind(tensor.dtype)} tensor cannot take {_kind(source.dtypes[name])}"
                             " values. Is it a checkpoint of another model?")
    with torch.no_grad():
        for key, tensor in state.items():
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                # several for a strided shard or a fused projection stored in rank order
                for offsets, sizes, local_region in local_boxes(tensor, layouts.get(key)):
                    region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                    source.copy_into(names[key], region, local[local_region])
            else:
                source.copy_into(names[key], (), tensor)


def _names(keys: list[str], available: dict, path: str, renames: dict[str, str],
           partners: dict[str, str]) -> dict[str, str]:
    """This rank's keys -> the checkpoint's: renamed by the longest matching prefix in ``renames``; else as
    they are, or without their first component (``model.``), whichever covers every key. A key in
    ``partners`` (the second of a tied pair) the file lacks is read under its partner's name."""
    def by_prefix(key: str) -> str:
        prefix = max((p for p in renames if key.startswith(p)), key=len, default="")
        return renames[prefix] + key[len(prefix):] if prefix else key

    def strip(key: str) -> str:
        return key.split(".", 1)[1] if "." in key else key

    def found(key: str, rename) -> list[str]:
        return [rename(k) for k in (key, partners.get(key)) if k is not None and rename(k) in available]

    for rename in [by_prefix] if renames else [by_prefix, strip]:  # by_prefix without renames: as they are
        if all(found(key, rename) for key in keys):
            return {key: found(key, rename)[0] for key in keys}
    missing = next(k for k in keys if not found(k, by_prefix))
    if renames:
        raise KeyError(f"init_from={path!r} has no {by_prefix(missing)!r} (the policy's name for {missing!r}); it"
                       f" has e.g. {sorted(available)[:3]}.")
    raise KeyError(f"init_from={path!r} has no {missing!r} (nor {strip(missing)!r}); it has e.g."
                   f" {sorted(available)[:3]}. Is it a checkpoint of another model?")


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating-point"
    return "boolean" if dtype == torch.bool else "integer"


def _open(path: Path) -> Source:
    if path.is_dir() and not (path / INDEX).exists():
        path = path / SINGLE
    if path.is_dir():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        missing = sorted(file for file in set(weight_map.values()) if not (path / file).exists())
        if missing:
            raise FileNotFoundError(f"init_from={str(path)!r}: {INDEX} names {missing} which are not there (a"
                                    " download or copy cut short?).")
        readers = {file: SafetensorsReader(path / file) for file in set(weight_map.values())}
        return Source({name: readers[file].shape(name) for name, file in weight_map.items()},
                      {name: readers[file].dtype(name) for name, file in weight_map.items()},
                      lambda name, region, out: readers[weight_map[name]].copy_into(name, region, out))
    if path.suffix == ".safetensors":
        reader = SafetensorsReader(path)
        return Source({name: reader.shape(name) for name in reader.keys()},
                      {name: reader.dtype(name) for name in reader.keys()}, reader.copy_into)
    loaded = torch_load(path, what="init_from", map_location="cpu", mmap=True)
    tensors = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    return Source({name: tuple(t.shape) for name, t in tensors.items()}, {name: t.dtype for name, t in tensors.items()},
                  lambda name, region, out: out.copy_(tensors[name][region]))
