"""Step time of ``compile=True`` (torch.compile per block, inductor) vs eager, on CPU, side by side.

    python benchmarks/compile_vs_eager.py [--layouts pp2,tp2] [--rounds 3] [--steps 20] [--n-layer 4] [--n-embd 128]

One torchrun launch of 2 processes; per layout (pp2: 1F1B over 2 stages, 4 micro-batches; tp2: tensor
parallel over 2 ranks) it alternates a compiled and an eager run (``timing.compare``) and prints both median
step times and their ratio (< 1: compiled is faster). Compilation happens in the untimed warm-up steps
(``timing.WARMUP_STEPS``); the compiled runs after the first reuse its graphs (same block class and shapes).
"""

from __future__ import annotations

import argparse

from timing import compare, ensure_torchrun, step_times

LAYOUTS = {"pp2": dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", num_microbatches=4),
           "tp2": dict(tensor_parallel_size=2)}
"""What each layout gives ThreeDStrategy: 2 ranks each."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="pp2,tp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ensure_torchrun(2)
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, vocab_size=256)

    def run(layout: str, compiled: bool) -> list[float]:
        L.seed_everything(0, verbose=False)
        data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=args.batch_size,
                                   num_train_samples=args.batch_size * (args.steps + 10))
        strategy = ThreeDStrategy(**LAYOUTS[layout], compile=compiled)
        return step_times(strategy, GPTLightningModule(config=config), data, args.steps, 2)

    for layout in args.layouts.split(","):
        compare({"compiled": lambda: run(layout, True), "eager": lambda: run(layout, False)}, args.rounds,
                f"{layout}: GPT n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len}"
                f" batch={args.batch_size}, {args.steps} timed steps per run")


if __name__ == "__main__":
    main()
