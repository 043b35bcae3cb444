"""Step time of ThreeDStrategy (data parallel) vs Lightning's DDPStrategy, same model, data and processes.

    python benchmarks/dp_vs_ddp.py [--rounds 3] [--steps 40] [--n-layer 4] [--n-embd 128] [--nprocs 2]

Starts itself under torchrun; in that one launch it alternates the two strategies ``rounds`` times (so both
see the same machine state), times every optimizer step after a warm-up, and prints each run's median step
time and the ratio of the medians (ThreeD / DDP; < 1 means ThreeD is faster).
"""

from __future__ import annotations

import argparse

from timing import compare, ensure_torchrun, step_times


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two strategies")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    parser.add_argument("--nprocs", type=int, default=2, help="data-parallel processes")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ensure_torchrun(args.nprocs)
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    def run(strategy) -> list[float]:
        L.seed_everything(0, verbose=False)
        config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len,
                           vocab_size=256)
        data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=args.batch_size,
                                   num_train_samples=args.batch_size * args.nprocs * (args.steps + 10))
        return step_times(strategy(), GPTLightningModule(config=config), data, args.steps, args.nprocs)

    compare({"ThreeDStrategy": lambda: run(ThreeDStrategy), "DDPStrategy": lambda: run(lambda: "ddp")},
            args.rounds,
            f"GPT n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len} batch/proc={args.batch_size},"
            f" {args.nprocs} processes (data parallel), {args.steps} timed steps per run")


if __name__ == "__main__":
    main()
