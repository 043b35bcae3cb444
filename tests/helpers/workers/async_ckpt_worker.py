"""Jobs with asynchronous checkpoints (``ThreeDStrategy(async_checkpoint=True)``), one after another in one
launch; rank 0 saves each job's result.

    forkrun.py --nproc-per-node N async_ckpt_worker.py JOBS.json OUT_DIR

A job is ``ckpt_worker``'s (layout, model, steps, ``save_every``, ``ckpt_dir``, ``resume``) plus:
``save_last``; ``write_delay`` (seconds each DCP write sleeps first, in the background thread, so that
training overlaps it); ``capture_at`` (a step: the full weights then, just before that step's save);
``kill_rank_during_save`` with ``kill_at_save`` (that rank dies in its n-th DCP write, its shards written,
before the commit); ``may_fail`` (the launch may end in it: put it last). Its result adds what the writes
saw: the threads they ran in, how many overlapped, the wait messages logged, and the newest checkpoint's step
as soon as ``fit`` returned.
"""

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from helpers.harness import Case, LossRecorder, gather_full_state, module_and_data
from helpers.launchers import end_process_group, forkrun, run_forked
from helpers import WORKERS
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import GradNormMonitor
from lightning_3d.checkpoint import sharded


class WriteWatch:
    """Wraps DCP's ``FileSystemWriter.write_data`` (which runs in DCP's background thread under async_save):
    records its thread and the overlap of writes, optionally sleeps first or kills this rank after it."""

    def __init__(self) -> None:
        self.original = FileSystemWriter.write_data
        self.lock = threading.Lock()
        self.reset({})

    def reset(self, job: dict) -> None:
        self.job, self.count, self.in_flight, self.max_in_flight, self.threads = job, 0, 0, 0, []

    def write_data(self, writer, plan, planner):
        with self.lock:
            self.count += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.threads.append(threading.current_thread().name)
        try:
            time.sleep(self.job.get("write_delay", 0.0))
            written = self.original(writer, plan, planner)
            written.wait()
            if self.job.get("kill_rank_during_save") == dist.get_rank() and self.count == self.job["kill_at_save"]:
                Path(self.job["ckpt_dir"], "killed_in_thread").write_text(threading.current_thread().name)
                os.kill(os.getpid(), signal.SIGKILL)
            return written
        finally:
            with self.lock:
                self.in_flight -= 1


class Capture(L.Callback):
    """The full weights at the end of step ``at``: before ModelCheckpoint (Lightning runs it last) saves them."""

    def __init__(self, at: int) -> None:
        self.at, self.params = at, None

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == self.at:
            self.params = gather_full_state(module)


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def newest_step(directory: str) -> int | None:
    """The global step of the newest whole checkpoint in ``directory`` (what a commit has renamed into place)."""
    steps = [torch.load(p / sharded.META_FILE, weights_only=False)["global_step"]
             for p in Path(directory).glob("*.ckpt") if sharded.is_sharded_checkpoint(p)]
    return max(steps, default=None)


def run(job: dict, watch: WriteWatch, messages: Messages) -> dict:
    case = Case(name=job["name"], steps=job["steps"], model=job["model"], learning_rate=job.get("lr", 1e-2))
    dp = job["layout"].get("data_parallel_size", 1)
    module, data = module_and_data(case, case.global_batch_size // dp)
    recorder, capture = LossRecorder(), Capture(job.get("capture_at", -1))
    callbacks = [GradNormMonitor(every_n_steps=1), recorder, capture]  # the recorder reads the norm
    if job.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=job["ckpt_dir"], every_n_train_steps=job["save_every"],
                                         save_top_k=-1, save_last=job.get("save_last", False)))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=ThreeDStrategy(**job["layout"], async_checkpoint=True), max_steps=case.steps,
                        logger=False, enable_checkpointing=bool(job.get("save_every")), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=callbacks, default_root_dir=job.get("ckpt_dir"))
    watch.reset(job)
    messages.lines.clear()
    trainer.fit(module, data, ckpt_path=job.get("resume"))
    committed = newest_step(job["ckpt_dir"]) if job.get("save_every") else None  # at once: fit waited for it
    return {"losses": recorder.losses, "global_step": trainer.global_step, "params": gather_full_state(module),
            "captured": capture.params, "committed_when_fit_returned": committed, "write_threads": watch.threads,
            "max_writes_in_flight": watch.max_in_flight, "waits": [m for m in messages.lines if "waited" in m]}


def main(jobs_file: str, out_dir: str) -> None:
    watch, messages = WriteWatch(), Messages()
    FileSystemWriter.write_data = lambda writer, plan, planner: watch.write_data(writer, plan, planner)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addHandler(messages)
        logging.getLogger(name).setLevel(logging.INFO)
    for job in json.loads(Path(jobs_file).read_text()):
        result = run(job, watch, messages)
        if dist.get_rank() == 0:
            torch.save(result, Path(out_dir) / f"{job['name']}.pt")
            print(f"[async ckpt] {job['name']}: {result['losses']} waits={result['waits']}", flush=True)
    end_process_group()


def launch_jobs(nprocs: int, jobs: list[dict], out: Path, expect_failure: bool = False,
                timeout: float = 240) -> dict[str, dict]:
    """Run ``jobs`` in one launch of ``nprocs`` ranks; each finished job's result by its name. A launch with
    a ``may_fail`` job may end with an error (the fault watch ends every rank when one raises): the jobs
    before it keep their results, and a failed job has none."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs.json").write_text(json.dumps(jobs))
    args = [str(WORKERS / "async_ckpt_worker.py"), str(out / "jobs.json"), str(out)]
    if expect_failure or any(job.get("may_fail") for job in jobs):
        proc = run_forked(nprocs, args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)
        assert proc.returncode != 0 or not expect_failure, "the launch was expected to die"
    else:
        forkrun(nprocs, *args, timeout=timeout)
    return {job["name"]: torch.load(out / f"{job['name']}.pt", weights_only=False)
            for job in jobs if (out / f"{job['name']}.pt").exists()}


if __name__ == "__main__":
    main(*sys.argv[1:3])
