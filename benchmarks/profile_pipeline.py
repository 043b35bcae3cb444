"""Where a pipelined step's time goes, per rank: cProfile over steps 5-15 of one run (issue 19).

    python benchmarks/profile_pipeline.py [--schedule 1f1b] [--n-layer 8] [--n-embd 256] [--out profiles]

Starts itself under torchrun with pp=2 ranks (one thread each), the model and batch of
benchmarks/pipeline_efficiency.py (8 micro-batches of 2, sequence 128). Each rank writes
OUT/SCHEDULE_rankR.txt (functions by cumulative and by own time) and prints its step times in ms; read the
schedule's forward_one_chunk / backward_one_chunk against _wait_batch_p2p and the engine's own methods.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import ensure_torchrun, virtual_stages  # noqa: E402

FIRST, LAST = 5, 15  # profiled steps: after the schedule's first-step set-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--out", default="profiles")
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
    virtual = virtual_stages(args.schedule)
    strategy = ThreeDStrategy(pipeline_parallel_size=2, pipeline_schedule=args.schedule,
                              virtual_pipeline_size=virtual, num_microbatches=microbatches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    class Profile(L.Callback):
        def __init__(self) -> None:
            self.profile, self.ends = cProfile.Profile(), []

        def on_train_batch_start(self, trainer, *_args) -> None:
            if trainer.global_step == FIRST:
                self.profile.enable()

        def on_train_batch_end(self, trainer, *_args) -> None:
            self.ends.append(time.perf_counter())
            if trainer.global_step != LAST:
                return
            self.profile.disable()
            text = io.StringIO()
            for order, count in (("cumulative", 45), ("tottime", 30)):
                pstats.Stats(self.profile, stream=text).sort_stats(order).print_stats(count)
            rank = dist.get_rank()
            (out / f"{args.schedule}_rank{rank}.txt").write_text(text.getvalue())
            steps = [b - a for a, b in zip(self.ends[FIRST:LAST], self.ends[FIRST + 1:LAST + 1])]
            print(f"rank {rank}: step ms {[round(s * 1e3) for s in steps]}", flush=True)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=LAST + 2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Profile()])
    trainer.fit(GPTLightningModule(config=config), data)


if __name__ == "__main__":
    main()
