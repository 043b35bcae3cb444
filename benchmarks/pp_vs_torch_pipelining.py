"""Step time of ThreeDStrategy(pp) vs a hand-written loop over torch.distributed.pipelining, same layout.

    python benchmarks/pp_vs_torch_pipelining.py [--pp 2] [--microbatches 8] [--schedule 1f1b] [--rounds 3]

The hand-written side is what a PyTorch user writes without Lightning: the GPT built on every rank, the
modules of other stages deleted, ``PipelineStage`` + the schedule class, AdamW, a plain ``for`` loop over the
same batches from a DataLoader. The ThreeDStrategy side is a LightningModule written for one device under ``Trainer.fit``
(its data loader, callbacks and logging included). Both run the model and batch of
benchmarks/pipeline_efficiency.py (8 micro-batches of 2, sequence 128), one thread per process. One torchrun
launch alternates them and prints the median step times and their ratio (< 1: ThreeDStrategy is faster):
what the strategy costs over torch's own pipelining on this machine, apart from the schedule itself.
"""

from __future__ import annotations

import argparse
import time

from timing import WARMUP_STEPS, compare, ensure_torchrun, step_times, virtual_stages

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "zero_bubble": "ScheduleInterleavedZeroBubble"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (= processes)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULE_CLASSES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=2)
    return parser.parse_args()


def hand_written_steps(config, args: argparse.Namespace, loader) -> list[float]:
    """Seconds per step of a plain loop over torch.distributed.pipelining, after WARMUP_STEPS untimed steps;
    the batches are read from ``loader`` inside the loop, as Lightning reads them."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from lightning_3d.models import GPT

    torch.manual_seed(0)
    if not dist.is_initialized():  # when it runs first; Trainer.fit leaves its group for the next run
        dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    virtual = virtual_stages(args.schedule)
    count = ranks * virtual  # stage i on rank i % ranks, as ThreeDStrategy places them
    model = GPT(config)

    def stage_module(index: int) -> GPT:  # the model less other stages' modules; its forward skips them
        held = copy.deepcopy(model)
        for block in range(config.n_layer):
            if block * count // config.n_layer != index:
                del held.blocks[str(block)]
        if index != 0:
            held.tok_emb = held.pos_emb = None
        if index != count - 1:
            held.ln_f = held.lm_head = None
        return held

    modules = {index: stage_module(index) for index in range(rank, count, ranks)}
    stages = [pipelining.PipelineStage(m, i, count, torch.device("cpu")) for i, m in modules.items()]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # as GPTLightningModule

    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[args.schedule])
    schedule = schedule_class(stages if virtual > 1 else stages[0], args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=3e-4)
    ends = []
    for _, (tokens, targets) in zip(range(args.steps + WARMUP_STEPS), loader):
        if rank == 0:
            schedule.step(tokens)
        elif rank == ranks - 1:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends[WARMUP_STEPS - 1:], ends[WARMUP_STEPS:])]


def main() -> None:
    args = parse_args()
    ensure_torchrun(args.pp)
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, vocab_size=256)
    batch = args.microbatch_size * args.microbatches

    def data() -> SyntheticDataModule:
        L.seed_everything(0, verbose=False)
        module = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=batch,
                                     num_train_samples=batch * (args.steps + WARMUP_STEPS + 5))
        module.setup("fit")
        return module

    def ours() -> list[float]:
        strategy = ThreeDStrategy(pipeline_parallel_size=args.pp, pipeline_schedule=args.schedule,
                                  virtual_pipeline_size=virtual_stages(args.schedule), num_microbatches=args.microbatches)
        return step_times(strategy, GPTLightningModule(config=config), data(), args.steps, args.pp)

    def hand_written() -> list[float]:
        return hand_written_steps(config, args, DataLoader(data().train_set, batch_size=batch))

    compare({"ThreeDStrategy": ours, "torch pipelining": hand_written}, args.rounds,
            f"GPT n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len}, pp={args.pp}, {args.schedule},"
            f" {args.microbatches} micro-batches of {args.microbatch_size}, {args.steps} timed steps per run")


if __name__ == "__main__":
    main()
