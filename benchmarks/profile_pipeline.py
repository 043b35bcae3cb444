"""The pipeline engine's own cost per step, per rank, beside the schedule's and the whole step's (issues 19, 30).

    python benchmarks/profile_pipeline.py [--schedule 1f1b] [--n-layer 8] [--n-embd 256] [--cprofile DIR]

Starts itself under torchrun with pp=2 ranks (one thread each), the model and batch of
benchmarks/pipeline_efficiency.py (8 micro-batches of 2, sequence 128), and prints per rank the median over
steps 5-15, in ms, of the parts the engine times in every step (``PipelineEngine.costs``,
lightning_3d/pipeline/step_costs.py; perf_counter, no profiler):

  capture      the user's training_step per micro-batch up to the model call, the random state's snapshot/replay
  sharing      the step's results (return value, logged values, metric states) from the last stage to every rank
  bookkeeping  the rest of the engine: schedule lookup, gradients set aside and handed back, the loss function's
               wrapper, checks
  engine       capture + sharing + bookkeeping
  schedule     torch.distributed.pipelining's step: forwards, backwards, sends, receives and waits
  user loss    the user's training_step on the last stage's output (its loss code)
  step         one Lightning training batch, end to end (with the optimizer step and the loop), for scale

A part with a collective (sharing) includes waiting for the other rank to reach it. Medians are per column, so
they need not add up; engine % is the median of the steps' engine / step. ``--cprofile DIR`` also writes
DIR/SCHEDULE_rankR.txt, cProfile over the same steps; cProfile inflates Python-heavy code, the engine's above
all, so the table is then no measure of it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import ensure_torchrun, virtual_stages  # noqa: E402

FIRST, LAST = 5, 15  # reported steps (batch indices): after the schedule's first-step set-up
ENGINE_PARTS = ("capture", "sharing", "bookkeeping")
COLUMNS = (*ENGINE_PARTS, "engine", "schedule", "user_loss", "step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b or zero_bubble")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--cprofile", metavar="DIR", help="also write cProfile's statistics per rank to DIR")
    args = parser.parse_args()
    ensure_torchrun(2)

    import lightning as L
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    L.seed_everything(0, verbose=False)
    microbatches, microbatch_size = 8, 2
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=128, vocab_size=256)
    data = SyntheticDataModule(vocab_size=256, seq_len=128, num_train_samples=microbatch_size * microbatches * 30,
                               batch_size=microbatch_size * microbatches)
    strategy = ThreeDStrategy(pipeline_parallel_size=2, pipeline_schedule=args.schedule,
                              virtual_pipeline_size=virtual_stages(args.schedule), num_microbatches=microbatches)

    class StepCostReport(L.Callback):
        def __init__(self) -> None:
            self.ends: dict[int, float] = {}
            self.rows: list[dict[str, float]] = []  # one per reported step, in ms
            self.profile = cProfile.Profile() if args.cprofile else None

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if self.profile is not None and batch_idx == FIRST:
                self.profile.enable()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.ends[batch_idx] = time.perf_counter()
            if batch_idx < FIRST:
                return
            row = {name: 1e3 * trainer.strategy.pipeline_engine.costs.seconds.get(name, 0.0)
                   for name in (*ENGINE_PARTS, "schedule", "user_loss")}
            row["engine"] = sum(row[name] for name in ENGINE_PARTS)
            row["step"] = 1e3 * (self.ends[batch_idx] - self.ends[batch_idx - 1])
            self.rows.append(row)
            if batch_idx == LAST:
                self.report()

        def report(self) -> None:
            rank = dist.get_rank()
            if self.profile is not None:
                self.profile.disable()
                text = io.StringIO()
                for order, count in (("cumulative", 45), ("tottime", 30)):
                    pstats.Stats(self.profile, stream=text).sort_stats(order).print_stats(count)
                Path(args.cprofile).mkdir(parents=True, exist_ok=True)
                (Path(args.cprofile) / f"{args.schedule}_rank{rank}.txt").write_text(text.getvalue())
            medians = {name: statistics.median(row[name] for row in self.rows) for name in COLUMNS}
            medians["engine %"] = 100 * statistics.median(row["engine"] / row["step"] for row in self.rows)
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, medians)
            if rank == 0:
                print(f"\n{args.schedule}, GPT {args.n_layer} x {args.n_embd}, pp=2, {microbatches} micro-batches"
                      f" of {microbatch_size}: median of steps {FIRST}-{LAST}, ms"
                      f"{' (under cProfile: inflated)' if self.profile else ''}")
                header = [name.replace("_", " ") for name in (*COLUMNS, "engine %")]
                print("rank " + " ".join(f"{name:>11}" for name in header))
                for r, values in enumerate(per_rank):
                    print(f"{r:>4} " + " ".join(f"{value:11.2f}" for value in values.values()))

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=LAST + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[StepCostReport()])
    trainer.fit(GPTLightningModule(config=config), data)


if __name__ == "__main__":
    main()
