"""SIGTERM during a pipelined fit on 2 ranks (tests/faults/test_stop_signal.py): one rank sends itself SIGTERM
after batch 2; then a fit that no signal interrupts, in the same processes. Each rank writes ``rankN.json``:
per fit, the batches it started and the exception the fit ended with (None when it ran to the end).

    python -m torch.distributed.run --nproc-per-node 2 stop_signal_worker.py OUT_DIR SIGNALLED_RANK [...]

Each SIGNALLED_RANK is one interrupted fit, in the order given; the uninterrupted fit comes last.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

SIGNAL_AFTER_BATCH = 2
MAX_STEPS = 8


class Record(L.Callback):
    def __init__(self, signalled_rank: int | None) -> None:
        self.signalled_rank, self.started = signalled_rank, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started.append(batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == SIGNAL_AFTER_BATCH and trainer.global_rank == self.signalled_rank:
            os.kill(os.getpid(), signal.SIGTERM)


def fit(signalled_rank: int | None, out: Path) -> dict:
    L.seed_everything(0, verbose=False)
    record = Record(signalled_rank)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=MAX_STEPS, callbacks=[record], logger=False,
        strategy=ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2, hang_timeout=60),
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(out))
    ended = None
    try:
        trainer.fit(GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8)),
                    SyntheticDataModule(seq_len=8, batch_size=4, num_train_samples=4 * MAX_STEPS))
    except BaseException as exception:  # noqa: BLE001 -- SIGTERMException is a SystemExit
        ended = type(exception).__name__
    return {"signalled_rank": signalled_rank, "started": record.started, "ended": ended,
            "handler_restored": signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)}


def main(out_dir: str, signalled: list[str]) -> None:
    out = Path(out_dir)
    fits = [fit(int(rank), out) for rank in signalled] + [fit(None, out)]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(fits))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
