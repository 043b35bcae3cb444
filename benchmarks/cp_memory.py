"""Activation memory per rank of one long sequence under context parallelism, against one process.

    python benchmarks/cp_memory.py [--seq-len 8192] [--n-layer 4] [--n-embd 64] [--cp 1 2 4]

For each cp, one training step of the reference GPT on one sequence of ``--seq-len`` tokens, on cp gloo ranks
under torchrun (``ThreeDStrategy(context_parallel_size=cp)``). Each rank counts the bytes of the tensors its
forward saves for backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once): what it holds
between forward and backward, the activation memory of the step. Prints rank 0's count per cp and its ratio to
cp=1. The claim to check: it falls as 1/cp for the blocks, while the embeddings, the head and the loss stay
on the whole sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def measure(args: argparse.Namespace) -> None:
    """On every rank of one launch: one step; rank 0 writes its saved bytes to ``args.out``."""
    import lightning as L
    import torch

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    class Counted(GPTLightningModule):
        saved: dict[int, int] = {}

        def training_step(self, batch, batch_idx):
            def pack(tensor):
                storage = tensor.untyped_storage()
                self.saved[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, vocab_size=256)
    module = Counted(config=config)
    trainer = L.Trainer(accelerator="cpu", devices=args.cp, strategy=ThreeDStrategy(context_parallel_size=args.cp),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=1))
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(sum(Counted.saved.values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out:  # inside a launch
        args.cp = args.cp[0]
        return measure(args)
    saved = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            out = Path(tmp) / f"cp{cp}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
                   "--seq-len", str(args.seq_len), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
                   "--cp", str(cp), "--out", str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
            saved[cp] = json.loads(out.read_text())
    for cp, size in saved.items():
        ratio = f", {size / saved[args.cp[0]]:.3f}x cp={args.cp[0]}" if cp != args.cp[0] else ""
        print(f"cp={cp}: {size / 2**20:.1f} MiB saved for backward on rank 0{ratio}")


if __name__ == "__main__":
    main()
