"""One GPU, one rank, an NCCL-only process group: every collective the strategy, its callbacks and its
checkpoints run takes a device tensor, and nothing an object collective pickles carries a tensor.

    PYTHONPATH=.:tests python benchmarks/gpu_collectives.py [--cpu]   # --cpu: the same run on gloo, here

The default group on CUDA is "cuda:nccl,cpu:gloo" (gloo serves host tensors). This run makes it "cuda:nccl"
alone, so a host tensor that reaches a collective of the default group or of a mesh group fails the run
("No backend type associated with device type cpu") instead of passing through gloo; the recorder of
``tests/helpers/workers/payload_worker.py`` also lists each such call and each object collective that pickles
a tensor. With one rank every group has one member, so this proves device placement and pickling, not
multi-rank NCCL (NCCL refuses two ranks on one GPU). What runs: the reference GPT in bf16-mixed with
NaNGuard, GradNormMonitor, CommTimer and ThroughputMonitor at every step, clipping by the global norm, a
``sync_dist`` log, validation, a DCP checkpoint, a resume from it, and ``validate``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.workers.payload_worker import record
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import CommTimer, GradNormMonitor, NaNGuard, ThroughputMonitor
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


def trainer(root: Path, accelerator: str, backend: str, max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator, devices=1, precision="bf16-mixed", max_steps=max_steps, val_check_interval=2,
        limit_val_batches=2, gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        strategy=ThreeDStrategy(process_group_backend=backend),
        callbacks=[NaNGuard(), GradNormMonitor(every_n_steps=1), CommTimer(every_n_steps=1),
                   ThroughputMonitor(every_n_steps=1),
                   ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_last=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU: checks this script's own code paths")
    args = parser.parse_args()
    accelerator, backend = ("cpu", "gloo") if args.cpu else ("gpu", "cuda:nccl")
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_collectives.py needs a CUDA GPU (or --cpu)")
    seen = {"object": [], "device": [], "tensor_ops": 0}
    record(seen)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="gpu_collectives_"))
    config = GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=512, block_size=128)
    data = SyntheticDataModule(vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=8)
    L.seed_everything(1234, verbose=False)
    first = trainer(root, accelerator, backend, max_steps=4)
    first.fit(GPTLightningModule(config=config), data)
    losses = {k: float(v) for k, v in first.callback_metrics.items() if "loss" in k}
    resumed = trainer(root, accelerator, backend, max_steps=6)
    module = GPTLightningModule(config=config)
    resumed.fit(module, data, ckpt_path=str(root / "ckpt" / "last.ckpt"))
    resumed.validate(module, data, verbose=False)
    print(f"backend {dist.get_backend()}, device {module.device}, {time.perf_counter() - started:.1f} s;"
          f" after 4 steps {losses}; resumed to step {resumed.global_step},"
          f" val_loss {float(resumed.callback_metrics['val_loss']):.4f}")
    print(f"tensor collectives: {seen['tensor_ops']}; object collectives: {len(seen['object'])}")
    pickled = sorted({(c["op"], c["where"], ", ".join(c["tensors"][:3])) for c in seen["object"] if c["tensors"]})
    wrong = sorted({(c["op"], c["where"], str(c["devices"]), c["backend"]) for c in seen["device"]})
    for line in pickled:
        print("object collective pickles a tensor:", *line)
    for line in wrong:
        print("tensor collective on a device its backend does not serve:", *line)
    print("OK" if not (pickled or wrong) else "FAILED")
    dist.destroy_process_group()
    sys.exit(1 if pickled or wrong else 0)


if __name__ == "__main__":
    main()
