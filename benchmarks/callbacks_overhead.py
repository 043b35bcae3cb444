"""What all the lightning_3d callbacks together add to the step time at their default intervals.

    python benchmarks/callbacks_overhead.py [--rounds 4] [--steps 100] [--pp 2] [--tp 1] [--nprocs 2]

Starts itself under torchrun; in that one launch it alternates the same training with and without
GradNormMonitor, NaNGuard, ThroughputMonitor, CommTimer and PipelineMonitor (each at its defaults: every
``log_every_n_steps`` = 50 batches, NaNGuard every step), both with a TensorBoard logger. The callbacks do
most of their work in a few batches out of 50, so the ratios are of *mean* step times over all timed batches,
the logged ones included (``--steps`` a multiple of 50). Two clocks: wall time (what a user sees; noisy on a
shared machine) and the process CPU time of rank 0 (the work the callbacks add; barely moved by other
people's load). Target: <= 1.03.

Measured on 2 shared CPU cores (defaults: GPT 4 x 128, seq 64, pp=2, 4 micro-batches): with NaNGuard's
per-step agreement down to one int all-reduce (reports gathered only when a rank saw a NaN), CPU-time ratio
1.019 with all five (3 rounds x 100 steps; rounds 1.01, 1.02, 1.11); before that change 1.07-1.11, and 1.02
with the four monitors alone (``--callbacks GradNormMonitor,ThroughputMonitor,CommTimer,PipelineMonitor``).
NaNGuard checks every gradient of every micro-batch (one sum each), which on this tiny model is most of what
is left; ``NaNGuard(every_n_steps=k)`` trades it for later detection. Wall-clock ratios swung between 0.67
and 1.18 from run to run on the shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from timing import WARMUP_STEPS, ensure_torchrun

CALLBACKS = ("GradNormMonitor", "NaNGuard", "ThroughputMonitor", "CommTimer", "PipelineMonitor")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two runs")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per run")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (PipelineMonitor needs > 1)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank")
    parser.add_argument("--callbacks", default=",".join(CALLBACKS), help="which ones (comma-separated)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ensure_torchrun(args.nprocs)
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.loggers import TensorBoardLogger

    import lightning_3d.callbacks
    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    class Clocks(L.Callback):
        """Wall and CPU time at the end of every batch; first in the list, so the other callbacks' work at a
        batch's end lands in the next batch's time."""

        def __init__(self) -> None:
            self.ends: list[tuple[float, float]] = []

        def on_train_batch_end(self, *_args) -> None:
            self.ends.append((time.perf_counter(), time.process_time()))

    logs = tempfile.TemporaryDirectory(prefix="callbacks_overhead_")  # each rank's; removed at the end

    def run(with_callbacks: bool) -> tuple[float, float]:
        """Mean wall and CPU seconds per timed batch."""
        L.seed_everything(0, verbose=False)
        config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len,
                           vocab_size=256)
        data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=args.batch_size,
                                   num_train_samples=args.batch_size * args.nprocs * (args.steps + 10))
        strategy = ThreeDStrategy(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                                  num_microbatches=args.microbatches if args.pp > 1 else None)
        clocks = Clocks()
        watchers = [getattr(lightning_3d.callbacks, name)() for name in args.callbacks.split(",")]
        L.Trainer(accelerator="cpu", devices=args.nprocs, strategy=strategy, max_steps=args.steps + WARMUP_STEPS,
                  logger=TensorBoardLogger(logs.name), enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                  callbacks=[clocks, *(watchers if with_callbacks else [])],
                  ).fit(GPTLightningModule(config=config), data)
        (wall0, cpu0), (wall1, cpu1) = clocks.ends[WARMUP_STEPS - 1], clocks.ends[-1]
        return (wall1 - wall0) / args.steps, (cpu1 - cpu0) / args.steps

    names = {"all callbacks": True, "none": False}
    means: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else reversed(list(names)):
            means[name].append(run(names[name]))
    logs.cleanup()
    if dist.get_rank() == 0:
        print(f"\n{args.callbacks} at their default intervals")
        print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len} batch/dp rank={args.batch_size},"
              f" {args.nprocs} processes, tp={args.tp} pp={args.pp}, {args.steps} timed steps per run")
        for name, values in means.items():
            print(f"  {name:>14}: mean step {' '.join(f'{w * 1e3:7.2f}' for w, _ in values)} ms wall,"
                  f" {' '.join(f'{c * 1e3:7.2f}' for _, c in values)} ms CPU (rank 0)")
        for clock, i in (("wall", 0), ("CPU", 1)):
            ratio = (statistics.median(v[i] for v in means["all callbacks"])
                     / statistics.median(v[i] for v in means["none"]))
            print(f"ratio all callbacks / none, {clock} time per step: {ratio:.3f}")


if __name__ == "__main__":
    main()
