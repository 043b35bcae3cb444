"""One GPU: ``layout="auto"`` on the 1B GPT of gpu_smoke.py under a memory budget, against what it then uses.

    PYTHONPATH=. python benchmarks/gpu_layout_auto.py [--budget-gib 30] [--steps 12]
    PYTHONPATH=. python benchmarks/gpu_layout_auto.py --cpu      # the tiny model on CPU: the code path only

With one rank the decision is among recompute modes (and ZeRO, which does nothing at dp = 1): with the
budget below what training without recompute takes (43 GiB measured by gpu_smoke.py on an H200), the
planner must pick a recompute mode whose peak fits. Prints the decision's report, the calibration, the
predicted step time and memory, and the measured step time and peak device memory
(``torch.cuda.max_memory_allocated``), and whether the peak stayed within the budget.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch

from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    if args.cpu:
        config, batch, budget = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32), 4, 2**30
    else:
        config = GPTConfig(n_layer=16, n_embd=2048, n_head=16, vocab_size=50304, block_size=2048)
        batch, budget = 8, int(args.budget_gib * 2**30)
    L.seed_everything(0, verbose=False)
    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, *_args) -> None:
            if torch.cuda.is_available() and not args.cpu:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    strategy = ThreeDStrategy(layout="auto", max_memory_per_device=budget, layout_check_steps=args.steps - 4)
    trainer = L.Trainer(accelerator="cpu" if args.cpu else "gpu", devices=1, strategy=strategy,
                        precision="bf16-mixed", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[Clock()])
    data = SyntheticDataModule(vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=batch,
                               num_train_samples=batch * (args.steps + 2))
    if not args.cpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(GPTLightningModule(config=config, learning_rate=3e-4), data)
    decision = strategy.layout_decision
    steps = [b - a for a, b in zip(ends[2:], ends[3:])]
    measured = statistics.median(steps)
    peak = None if args.cpu else torch.cuda.max_memory_allocated()
    print(decision.report)
    print(f"calibration: {decision.calibration.to_dict() if decision.calibration else None}")
    print(f"chosen {decision.layout.describe()}: predicted {decision.predicted_step_s * 1e3:.1f} ms/step,"
          f" {decision.predicted_memory_bytes / 2**30:.2f} GiB; measured {measured * 1e3:.1f} ms/step"
          f" (x{measured / decision.predicted_step_s:.2f})"
          + ("" if peak is None else f", peak {peak / 2**30:.2f} GiB of a {budget / 2**30:.1f} GiB budget:"
             f" {'within' if peak <= budget else 'OVER'}"))


if __name__ == "__main__":
    main()
