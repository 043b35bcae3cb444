"""Consolidate a sharded checkpoint into one state-dict file for the single-device model.

    lightning-3d convert CKPT_DIR OUT.safetensors [--strip-prefix model.]
    lightning-3d convert CKPT_DIR OUT.pt
    lightning-3d convert CKPT_DIR OUT_DIR --hf        # a Hugging Face model directory (HFCausalLMModule)

Runs in one process with no process group: DCP reads each tensor's shards straight from the files. The
safetensors output is streamed -- the header is written from the checkpoint's metadata, then one tensor at
a time is read whole and written, so peak memory is about the largest tensor. ``torch.save`` needs the whole
dict at once, so the ``.pt`` output holds the model in memory once.

Why not torch's Hugging Face writers (their outputs hold the same tensors and a byte-identical data section, and
``from_pretrained`` loads each): ``HuggingFaceStorageWriter`` saves a state dict held in memory, so an export
through it first loads the whole model (here: streamed, about the largest tensor) and adds DCP's sharding
offsets to the file's metadata. ``_consolidate_hf_safetensors`` streams one tensor at a time in less CPU time
(ours makes one DCP load per tensor), but only from shards that writer wrote with
``save_distributed=True``, not from our checkpoints (DCP's own format, optimizer state included); it is
private, writes no ``format`` metadata nor an aligned header, and fails on integer tensors (``torch.finfo``).
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_3d.checkpoint.safe_load import CheckedReader
from lightning_3d.checkpoint.safetensors_io import SafetensorsWriter
from lightning_3d.checkpoint.sharded import check_complete, read_meta

MODEL_PREFIX = "model."  # DCP name of the model state in our checkpoints: "model.<fqn>"


def consolidate(checkpoint: str | Path, out: str | Path, strip_prefix: str = "") -> dict[str, tuple]:
    """Write the model state of ``checkpoint`` to ``out`` (``.safetensors``, else ``torch.save``), keys
    being the LightningModule's state-dict names with ``strip_prefix`` removed (e.g. ``"model."`` to load
    into the inner ``nn.Module``). Returns what it wrote: name -> (shape, dtype).

    Example::

        consolidate("checkpoints/last.ckpt", "gpt.safetensors", strip_prefix="model.")
        GPT(config).load_state_dict(safetensors.torch.load_file("gpt.safetensors"), strict=True)
    """
    checkpoint, out = Path(checkpoint), Path(out)
    check_complete(checkpoint)
    entries = CheckedReader(checkpoint).read_metadata().state_dict_metadata
    specs: dict[str, tuple] = {}
    sources: dict[str, str] = {}
    for key, entry in entries.items():
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata):
            name = key[len(MODEL_PREFIX):]
            if not name.startswith(strip_prefix):
                raise ValueError(f"{name} does not start with strip_prefix={strip_prefix!r}; leave it out or pass"
                                 " the prefix every model key has.")
            name = name[len(strip_prefix):]
            specs[name] = (tuple(entry.size), entry.properties.dtype)
            sources[name] = key
    if not specs:
        raise ValueError(f"{checkpoint} holds no model tensors (was it saved by lightning_3d?).")
    specs = dict(sorted(specs.items()))  # the same file whatever layout wrote the checkpoint (dp, pp, tp)
    if out.suffix == ".safetensors":
        with SafetensorsWriter(out, specs) as writer:
            for name, (shape, dtype) in specs.items():
                writer.write(name, _read(checkpoint, sources[name], shape, dtype))
    else:
        torch.save({name: _read(checkpoint, sources[name], *specs[name]) for name in specs}, out)
    return specs


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> dict[str, tuple]:
    """Write a checkpoint of :class:`~lightning_3d.models.HFCausalLMModule` as a Hugging Face model directory:
    ``config.json`` (rebuilt from the module's saved hyper-parameters) and ``model.safetensors`` (the inner
    model's state, streamed as :func:`consolidate` does), which ``AutoModelForCausalLM.from_pretrained`` loads.

    Example::

        export_hf("checkpoints/last.ckpt", "llama-finetuned")
        AutoModelForCausalLM.from_pretrained("llama-finetuned")
    """
    from lightning_3d.models.hf import hf_config

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    check_complete(checkpoint)
    hparams = read_meta(checkpoint).get("hyper_parameters") or {}
    if "model_type" not in hparams:
        raise ValueError(f"{checkpoint} was not written by an HFCausalLMModule (its hyper-parameters have no"
                         " model_type); convert it to a state-dict file instead (without --hf).")
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config(hparams["model_type"], hparams.get("config"), hparams.get("pretrained")).save_pretrained(out_dir)
    return consolidate(checkpoint, out_dir / "model.safetensors", strip_prefix=MODEL_PREFIX)


def _read(checkpoint: Path, key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # DCP warns that it "assumes" one process even when asked for one with no_dist=True, as here.
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        dcp.load({key: tensor}, storage_reader=CheckedReader(checkpoint), no_dist=True)
    return tensor


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-3d convert", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory written by lightning_3d")
    parser.add_argument("out", help="output file: .safetensors (streamed) or anything else (torch.save)")
    parser.add_argument("--strip-prefix", default="", help='remove this from every key, e.g. "model."')
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face model directory (config.json + model.safetensors) to OUT")
    args = parser.parse_args(argv)
    if args.hf:
        specs = export_hf(args.checkpoint, args.out)
    else:
        specs = consolidate(args.checkpoint, args.out, args.strip_prefix)
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    print(f"wrote {len(specs)} tensors, {total / 2**20:.1f} MiB, to {args.out}")
