"""Checkpoint jobs, run one after another in one launch (torchrun); rank 0 saves each job's result.

    python -m torch.distributed.run --standalone --nproc-per-node N ckpt_worker.py JOBS.json OUT_DIR

A job trains the harness's GPT case (or another ``module`` of the harness) at a layout, optionally writing checkpoints (``save_every`` steps, to
``ckpt_dir``) and optionally resuming (``resume``: a path or "last"); a job with ``expect_error`` must fail
while loading, and its error is the result. ``kill_rank_during_save`` (with ``kill_at_save``) kills that rank
in the middle of its n-th save, after its shards are written and before the commit: the launch dies there.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import WORKERS
from helpers.harness import Case, LossRecorder, gather_full_state, module_and_data
from helpers.launchers import end_process_group, forkrun, run_forked
from lightning_3d import ThreeDStrategy
from lightning_3d.callbacks import GradNormMonitor
from lightning_3d.checkpoint import sharded


def run(job: dict) -> dict:
    case = Case(name=job["name"], steps=job["steps"], model=job["model"], learning_rate=job.get("lr", 1e-2),
                module=job.get("module", "gpt"))
    dp = job["layout"].get("data_parallel_size", 1)
    module, data = module_and_data(case, case.global_batch_size // dp)
    recorder = LossRecorder()
    callbacks = [GradNormMonitor(every_n_steps=1), recorder]
    if job.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=job["ckpt_dir"], every_n_train_steps=job["save_every"],
                                         save_top_k=-1, save_last=True))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=ThreeDStrategy(**job["layout"]), max_steps=case.steps, logger=False,
                        enable_checkpointing=bool(job.get("save_every")), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
                        default_root_dir=job.get("ckpt_dir"))
    try:
        trainer.fit(module, data, ckpt_path=job.get("resume"))
    except Exception as err:  # noqa: BLE001 -- the error is the result of an expect_error job
        if not job.get("expect_error"):
            raise
        return {"error": f"{type(err).__name__}: {err}"}
    assert not job.get("expect_error"), f"{job['name']} was expected to fail"
    return {"losses": recorder.losses, "global_step": trainer.global_step, "params": gather_full_state(module)}


def launch_jobs(nprocs: int, jobs: list[dict], out: Path, expect_failure: bool = False) -> dict[str, dict]:
    """Run ``jobs`` one after another in one launch of ``nprocs`` ranks; each job's result by its name (a job
    that wrote none -- the launch died first -- is left out)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs.json").write_text(json.dumps(jobs))
    args = [str(WORKERS / "ckpt_worker.py"), str(out / "jobs.json"), str(out)]
    if expect_failure:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = run_forked(nprocs, args, env=env, timeout=300)
        assert proc.returncode != 0, "the launch was expected to die"
    else:
        forkrun(nprocs, *args, timeout=600)
    return {job["name"]: torch.load(out / f"{job['name']}.pt", weights_only=False)
            for job in jobs if (out / f"{job['name']}.pt").exists()}


def kill_during_save(rank: int, at_save: int) -> None:
    """Make ``rank`` die (SIGKILL) in its ``at_save``-th save, once its shards are on disk."""
    original, count = sharded.atomic.write_synced, {"saves": 0}

    def write_then_die(obj, path):
        original(obj, path)
        if path.parent.name == sharded.RNG_DIR:  # written by every rank once per save, after its shards
            count["saves"] += 1
            if dist.get_rank() == rank and count["saves"] == at_save:
                os.kill(os.getpid(), signal.SIGKILL)

    sharded.atomic.write_synced = write_then_die


def main(jobs_file: str, out_dir: str) -> None:
    for job in json.loads(Path(jobs_file).read_text()):
        if "kill_rank_during_save" in job:
            kill_during_save(job["kill_rank_during_save"], job["kill_at_save"])
        result = run(job)
        if dist.get_rank() == 0:
            torch.save(result, Path(out_dir) / f"{job['name']}.pt")
            print(f"[ckpt] {job['name']}: {result.get('losses', result.get('error'))}", flush=True)
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
