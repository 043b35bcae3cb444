"""Entry point of the collective-payload launch (tests/parity/test_collective_payloads.py): a pp2 x tp2 run
with every callback that talks to other ranks, torchmetrics, masking before the model call, validation, a
checkpoint and clipping, while a recorder wraps torch.distributed's collectives; each rank writes what it saw.

    python -m torch.distributed.run --standalone --nproc-per-node 4 payload_worker.py OUT_DIR
"""

import json
import os
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from helpers.harness import SEED
from helpers.idioms import CONFIG, GLOBAL_BATCH, ConformanceModule, ValidationData
from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import CommTimer, GradNormMonitor, NaNGuard, PipelineMonitor, ThroughputMonitor
from lightning_3d.models import GPTConfig

OBJECT_COLLECTIVES = ["broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"]
TENSOR_COLLECTIVES = ["broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                      "reduce", "send", "recv", "isend", "irecv"]
SERVES = {"gloo": {"cpu"}, "nccl": {"cuda"}}


def tensors_in(obj, seen=None) -> list[str]:
    """Where ``obj`` holds a torch.Tensor, walking containers and objects' attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [f"{type(obj).__name__}{tuple(obj.shape)} on {obj.device}"]
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [found for child in children for found in tensors_in(child, seen)]


def served(group) -> set[str]:
    """The device types ``group``'s backend serves ("cuda:nccl,cpu:gloo" -> {"cuda", "cpu"})."""
    backend = dist.get_backend(group)
    if ":" in backend:
        return {part.split(":")[0].strip() for part in backend.split(",")}
    return SERVES.get(backend, set())


def caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "payload_worker" not in f.filename]
    ours = [f for f in frames if "lightning_3d" in f.filename] or frames
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno} in {ours[-1].name}"


def record(seen: dict) -> None:
    for name in OBJECT_COLLECTIVES:
        original = getattr(c10d, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            found = tensors_in(list(args[:1]) + [v for k, v in kwargs.items() if k.startswith("object")])
            seen["object"].append({"op": _name, "where": caller(), "tensors": found})
            return _original(*args, **kwargs)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    for name in TENSOR_COLLECTIVES:
        original = getattr(c10d, name)

        def wrapped(tensor, *args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
            if devices - served(group or dist.group.WORLD):
                seen["device"].append({"op": _name, "where": caller(), "devices": sorted(devices),
                                       "backend": dist.get_backend(group or dist.group.WORLD)})
            seen["tensor_ops"] += 1
            return _original(tensor, *args, **kwargs)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def main(out_dir: str) -> None:
    seen = {"object": [], "device": [], "tensor_ops": 0}
    record(seen)
    L.seed_everything(SEED, verbose=False)
    config = GPTConfig(**CONFIG)
    module = ConformanceModule(config, route="gpt", mask_rate=0.15)
    data = ValidationData(vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=GLOBAL_BATCH,
                          num_val_samples=22, seed=SEED)
    # Full logits (vocab_parallel_loss=False): torchmetrics takes plain tensors, not vocabulary shards.
    strategy = ThreeDStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2,
                              vocab_parallel_loss=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=4, val_check_interval=2, gradient_clip_val=0.5,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        callbacks=[NaNGuard(), GradNormMonitor(every_n_steps=1), PipelineMonitor(every_n_steps=2), CommTimer(every_n_steps=2),
                   ThroughputMonitor(every_n_steps=2), EarlyStopping(monitor="val_loss", patience=5),
                   ModelCheckpoint(dirpath=Path(out_dir) / "ckpt", monitor="val_loss", save_last=True)])
    trainer.fit(module, data)
    trainer.validate(module, data)
    (Path(out_dir) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
