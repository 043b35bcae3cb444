"""Pipeline efficiency on CPU: pp ranks with m micro-batches vs the same model in one process.

    python benchmarks/pipeline_efficiency.py [--pp 2] [--microbatches 8] [--steps 10]

Each process gets one thread (OMP_NUM_THREADS=1), the single process too, so pp processes have pp times the
compute. The single process runs the same m micro-batches one after the other (gradient accumulation), so
both sides do the same matmuls: that is the baseline the ideal speedup p*m/(m+p-1) (1F1B and GPipe) is
relative to. (One process on the whole batch at once is also printed: bigger matmuls are faster per
sample on CPU, so it is a stricter baseline than the theory's.) The script prints, per
schedule, the measured speedup over one process, its ratio to that ideal (target >= 0.85 for 1F1B) and the
bubble fraction implied by the measurement, 1 - speedup/p, next to the theoretical (p-1)/(m+p-1) (for the
interleaved schedules with v virtual stages: (p-1)/(v*m+p-1)). With ``--torch`` each schedule also runs as a
hand-written loop over torch.distributed.pipelining (no Lightning, no lightning_3d): how close PyTorch's own
schedule gets to the ideal on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import step_times, virtual_stages


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zero_bubble")
    parser.add_argument("--torch", action="store_true",
                        help="also run each schedule as a hand-written torch.distributed.pipelining loop"
                             " (benchmarks/pp_vs_torch_pipelining.py): the same schedule without Lightning or us")
    parser.add_argument("--worker", nargs=2, metavar=("SCHEDULE", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    """One timed run (under torchrun): ``single`` in one process, or a schedule on ``pp`` processes."""
    import lightning as L
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    schedule, out = args.worker
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, vocab_size=256)
    batch = args.microbatch_size * args.microbatches
    if schedule.startswith("torch "):
        _hand_written_worker(args, schedule.split()[1], out, config, batch)
        return
    L.seed_everything(0, verbose=False)
    samples = batch * (args.steps + 10) * (args.microbatches if schedule == "sequential" else 1)
    data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, num_train_samples=samples,
                               batch_size=args.microbatch_size if schedule == "sequential" else batch)
    accumulate = args.microbatches if schedule == "sequential" else 1
    if schedule in ("single", "sequential"):
        strategy = ThreeDStrategy()
    else:
        strategy = ThreeDStrategy(pipeline_parallel_size=args.pp, pipeline_schedule=schedule,
                                  virtual_pipeline_size=virtual_stages(schedule), num_microbatches=args.microbatches)
    times = step_times(strategy, GPTLightningModule(config=config), data, args.steps * accumulate,
                       1 if schedule in ("single", "sequential") else args.pp, accumulate)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(statistics.median(times) * accumulate))  # seconds per optimizer step


def _hand_written_worker(args: argparse.Namespace, schedule: str, out: str, config, batch: int) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_3d.models import SyntheticDataModule
    from pp_vs_torch_pipelining import hand_written_steps

    data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, num_train_samples=batch * (args.steps + 10))
    data.setup("fit")
    args.schedule = schedule
    times = hand_written_steps(config, args, DataLoader(data.train_set, batch_size=batch))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))


def launch(schedule: str, nprocs: int, args: argparse.Namespace, out: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           __file__, *sys.argv[1:], "--worker", schedule, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    p, m = args.pp, args.microbatches
    schedules = args.schedules.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        single = launch("sequential", 1, args, Path(tmp) / "sequential.json")
        whole = launch("single", 1, args, Path(tmp) / "single.json")
        names = [name for s in schedules for name in (s, f"torch {s}")[:2 if args.torch else 1]]
        rows = [(s, launch(s, p, args, Path(tmp) / f"{s.replace(' ', '_')}.json")) for s in names]
    print(f"\nGPT n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len}, {m} micro-batches of"
          f" {args.microbatch_size}, pp={p}, one thread per process.\nOne process: {single * 1e3:.1f} ms/step over"
          f" the {m} micro-batches in turn (the baseline), {whole * 1e3:.1f} ms/step on the whole batch at once")
    print(f"{'schedule':>23} {'ms/step':>8} {'speedup':>8} {'ideal':>6} {'ratio':>6} {'bubble':>7} {'theory':>7}")
    for schedule, seconds in rows:
        virtual = virtual_stages(schedule.split()[-1])
        ideal = p * virtual * m / (virtual * m + p - 1)
        speedup = single / seconds
        theory = (p - 1) / (virtual * m + p - 1)
        print(f"{schedule:>23} {seconds * 1e3:8.1f} {speedup:8.2f} {ideal:6.2f} {speedup / ideal:6.2f}"
              f" {1 - speedup / p:7.2f} {theory:7.2f}")


if __name__ == "__main__":
    main()
