"""The step results' channel on 2 ranks (tests/parity/test_results_channel.py): rank 1 sends, rank 0 receives,
over a group of their own, for four steps; in steps 2-4 rank 0 posts its receive ahead (``expect``) and is then
busy for a second before it reads, as a first stage is with its last backward while the last stage sends. The
structure changes at step 3 (a logged value added). Rank 0 writes what it received and how long rank 1's sends
took. Then a pipelined fit (pp=2, 4 steps): rank 0 writes, per step, whether the results' receive had been
posted when the engine came to share them.

    python -m torch.distributed.run --nproc-per-node 2 results_channel_worker.py OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.pipeline.shared_results import ResultsChannel

BUSY_S = 1.0


def payload(step: int) -> dict:
    logs = {"loss": torch.tensor(1.0 / step)}
    if step >= 3:
        logs["acc"] = torch.tensor([step, 2 * step], dtype=torch.int64)
    return {"value": torch.full((2, 3), float(step)), "logs": logs}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    channel = ResultsChannel(1, group, torch.device("cpu"))
    received, send_seconds = [], []
    for step in range(1, 5):
        dist.barrier()  # both ranks start the step together
        if rank == 1:
            start = time.perf_counter()
            channel.share(payload(step))
            send_seconds.append(time.perf_counter() - start)
        else:
            channel.expect()  # no-op at step 1: the structure is not known yet
            time.sleep(BUSY_S if step > 1 else 0.0)
            got = channel.share(None)
            received.append({"value": got["value"].tolist(),
                             "logs": {name: value.tolist() for name, value in got["logs"].items()}})
    sends = [None, None]
    dist.all_gather_object(sends, send_seconds)
    posted = posted_in_a_fit()
    if rank == 0:
        expected = [{"value": payload(s)["value"].tolist(),
                     "logs": {n: v.tolist() for n, v in payload(s)["logs"].items()}} for s in range(1, 5)]
        (Path(out_dir) / "rank0.json").write_text(json.dumps(
            {"received": received, "expected": expected, "send_seconds": sends[1],
             "structure_sends": channel.structure_sends, "posted_in_fit": posted}))
    (Path(out_dir) / f"rank{rank}.done").write_text("")
    end_process_group()


def posted_in_a_fit() -> list[bool]:
    """Per training step of a pp=2 fit, on this rank: whether the engine's results channel had its receive posted
    (by the engine, before the step's work) when the step's results were shared."""
    seen = []
    share = ResultsChannel.share

    def recorded(channel, obj):
        seen.append((id(channel), channel._posted is not None))
        return share(channel, obj)

    ResultsChannel.share = recorded
    try:
        L.seed_everything(0, verbose=False)
        L.Trainer(accelerator="cpu", devices=2, strategy=ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2),
                  max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(
            GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32)),
            SyntheticDataModule(vocab_size=32, seq_len=8, batch_size=4, num_train_samples=16))
    finally:
        ResultsChannel.share = share
    engines = [channel for channel, _ in seen if sum(c == channel for c, _ in seen) > 1]  # not strategy.broadcast's
    return [posted for channel, posted in seen if channel in engines]


if __name__ == "__main__":
    main(sys.argv[1])
