"""The step-time stall of a checkpoint save: synchronous against asynchronous (``async_checkpoint=True``).

    python benchmarks/async_checkpoint.py [--rounds 1] [--nprocs 2] [--n-layer 2] [--n-embd 1024] [--vocab 32768]

Starts itself under torchrun. In that one launch it trains the reference GPT under tensor parallelism (each
rank holds, and writes, its half of the model and of AdamW's state) once per mode, alternating the modes
``rounds`` times, and saves a checkpoint (``trainer.save_checkpoint``) twice: at the end of step
``--first-save`` and ``--window`` + 1 steps later. The first asynchronous save allocates the host copy of
the state; the second reuses it, as every later save of a run does (the *steady* save). It prints, per mode
and save:

- the *stall*: how long ``trainer.save_checkpoint`` held the training loop (gathering the state dicts,
  staging, and for sync the whole write), and the saving step's excess over the median step without a
  save (the same stall seen in step time, noisier);
- the *overhead* over the window of steps from the save on (the save's step and ``--window`` more): under
  async_save the background write competes with training for the CPUs and the disk, and that slowdown is
  counted there;
- the size each rank wrote and how long the save call took;

and the ratio async / sync of the steady save's stall (the goal: <= 0.2).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from timing import ensure_torchrun


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="alternations of sync and async")
    parser.add_argument("--nprocs", type=int, default=2, help="tensor-parallel processes")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768, help="a large vocabulary: a large state, cheap steps")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--first-save", type=int, default=4, help="the first step that saves (before it: warm-up)")
    parser.add_argument("--window", type=int, default=6, help="steps after a save counted in its overhead")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ensure_torchrun(args.nprocs)
    import torch.distributed as dist

    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for round_index in range(args.rounds):
        for mode in ("sync", "async") if round_index % 2 == 0 else ("async", "sync"):
            with tempfile.TemporaryDirectory(prefix="async_ckpt_bench") as folder:
                results[mode].append(one_run(args, mode == "async", Path(folder)))
    if dist.get_rank() == 0:
        report(results, args)


def one_run(args: argparse.Namespace, async_checkpoint: bool, folder: Path) -> dict:
    """Train with two saves, each followed by ``window`` steps, then ``window`` more; step times and saves'."""
    import lightning as L
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    saves = {"first": args.first_save, "steady": args.first_save + args.window + 1}

    class SaveAndTime(L.Callback):
        """Records the end of every step; a saving step saves first, so that its time holds the stall."""

        def __init__(self) -> None:
            self.ends: dict[int, float] = {}
            self.save_s: dict[int, float] = {}

        def on_train_batch_end(self, trainer, *_args) -> None:
            step = trainer.global_step
            if step in saves.values():
                started = time.perf_counter()
                trainer.save_checkpoint(folder / f"step{step}.ckpt")
                self.save_s[step] = time.perf_counter() - started
            self.ends[step] = time.perf_counter()

    L.seed_everything(0, verbose=False)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, block_size=args.seq_len,
                       vocab_size=args.vocab)
    timer = SaveAndTime()
    strategy = ThreeDStrategy(tensor_parallel_size=args.nprocs, async_checkpoint=async_checkpoint)
    trainer = L.Trainer(accelerator="cpu", devices=args.nprocs, strategy=strategy, logger=False,
                        max_steps=saves["steady"] + 2 * args.window, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(GPTLightningModule(config), SyntheticDataModule(vocab_size=args.vocab, seq_len=args.seq_len,
                                                                batch_size=args.batch_size))
    step_s = {step: timer.ends[step] - timer.ends[step - 1] for step in timer.ends if step - 1 in timer.ends}
    in_a_window = {s + i for s in saves.values() for i in range(args.window + 1)}
    median = statistics.median(t for step, t in step_s.items() if step not in in_a_window and step > 2)
    written = sum(f.stat().st_size for f in (folder / f"step{saves['steady']}.ckpt").glob("*.distcp"))
    result = {"median_step": median, "mib_per_rank": written / dist.get_world_size() / 2**20}
    for name, step in saves.items():
        result[name] = {"stall": step_s[step] - median, "save_call": timer.save_s[step],
                        "overhead": sum(step_s[step + i] for i in range(args.window + 1)) - (args.window + 1) * median}
    return result


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(f"\nStall of a checkpoint save, {args.nprocs} ranks (tp={args.nprocs}), GPT n_layer={args.n_layer}"
          f" n_embd={args.n_embd} vocab={args.vocab}, AdamW")
    for mode, runs in results.items():
        for run in runs:
            print(f"  {mode:>5}: {run['mib_per_rank']:.0f} MiB written per rank; median step"
                  f" {run['median_step'] * 1e3:.0f} ms")
            for name in ("first", "steady"):
                save = run[name]
                print(f"         {name:>6} save: call {save['save_call']:.2f} s, stall {save['stall']:.2f} s,"
                      f" overhead over it and the next {args.window} steps {save['overhead']:.2f} s")
    for label, save, key in (("steady stall (save call)", "steady", "save_call"),
                             ("steady stall (saving step's excess)", "steady", "stall"),
                             ("first stall (save call; allocates the host copy)", "first", "save_call"),
                             ("steady overhead (the write's contention counted)", "steady", "overhead")):
        value = {mode: statistics.median(run[save][key] for run in runs) for mode, runs in results.items()}
        goal = " (goal <= 0.2)" if label.startswith("steady stall (save call)") else ""
        print(f"{label} async / sync: {value['async']:.2f} s / {value['sync']:.2f} s ="
              f" {value['async'] / value['sync']:.3f}{goal}")


if __name__ == "__main__":
    main()
