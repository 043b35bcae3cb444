"""Step time of ThreeDStrategy (data parallel) vs Lightning's DDPStrategy, same model, data and processes.

    python benchmarks/dp_vs_ddp.py [--rounds 3] [--steps 40] [--n-layer 4] [--n-embd 128] [--nprocs 2]

Starts itself under torchrun; in that one launch it alternates the two strategies ``rounds`` times (so both
see the same machine state), times every optimizer step after a warm-up, and prints each run's median step
time and the ratio of the medians (ThreeD / DDP; < 1 means ThreeD is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

WARMUP_STEPS = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two strategies")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (after a warm-up of 5)")
    parser.add_argument("--nprocs", type=int, default=2, help="data-parallel processes")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    return parser.parse_args()


def relaunch_under_torchrun(args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nprocs}",
           *sys.argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sys.exit(subprocess.call(cmd, env=env))


def time_one_run(strategy, args: argparse.Namespace) -> list[float]:
    import lightning as L

    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *_args) -> None:
            self.ends.append(time.perf_counter())

    L.seed_everything(0, verbose=False)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, vocab_size=256)
    module = GPTLightningModule(config=config)
    data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=args.batch_size,
                               num_train_samples=args.batch_size * args.nprocs * (args.steps + WARMUP_STEPS + 1))
    timer = StepTimer()
    L.Trainer(accelerator="cpu", devices=args.nprocs, strategy=strategy, max_steps=args.steps + WARMUP_STEPS,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer]).fit(module, data)
    return [b - a for a, b in zip(timer.ends[WARMUP_STEPS - 1:], timer.ends[WARMUP_STEPS:])]


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(args)
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy

    medians: dict[str, list[float]] = {"3d": [], "ddp": []}
    for round_index in range(args.rounds):
        for name in ("3d", "ddp") if round_index % 2 == 0 else ("ddp", "3d"):
            strategy = ThreeDStrategy() if name == "3d" else "ddp"
            steps = time_one_run(strategy, args)
            medians[name].append(statistics.median(steps))
    if dist.get_rank() == 0:
        print(f"\nmodel n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len} batch/proc={args.batch_size},"
              f" {args.nprocs} processes, {args.steps} timed steps per run")
        for name, values in medians.items():
            print(f"  {name:>3}: median step {' '.join(f'{v * 1e3:7.2f}' for v in values)} ms")
        ratio = statistics.median(medians["3d"]) / statistics.median(medians["ddp"])
        print(f"ratio ThreeDStrategy / DDPStrategy step time: {ratio:.3f}")


if __name__ == "__main__":
    main()
