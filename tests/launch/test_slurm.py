"""`srun ... lightning-3d fit` on a real Slurm: a two-node cluster emulated on this host by
scripts/slurm/local_cluster.sh (it installs Debian's Slurm and munge when they are missing).

The run must take its ranks from Lightning's SLURMEnvironment, sit where the rank layout says, and train
exactly as the same config started with torchrun's environment (ranks forked by tests/helpers/forkrun.py)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from helpers.cli_probe import read_ranks
from helpers.launchers import GLOO_EXIT_ABORT, forkrun
from lightning_3d.parallel.dims import ParallelDims

# Installs Debian's Slurm and munge as root and starts daemons: `python -m pytest tests -m "not slurm"` skips it.
pytestmark = pytest.mark.slurm

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "local_cluster.sh"
TOOLS = ("slurmctld", "slurmd", "srun", "munged", "mungekey")

# The README's 3D config, shrunk to 4 ranks as tp=2 inside a node and pp=2 across the two nodes (dp=1): the
# multi-node GPU layout in miniature. Both launches get these; only devices / num_nodes differ.
CONFIG = ROOT / "example_configs" / "gpt_tiny_3d_cpu.yaml"
STEPS = 4


def _overrides(out_dir: Path) -> list[str]:
    probe = f'[{{"class_path": "helpers.cli_probe.RankProbe", "init_args": {{"out_dir": "{out_dir}"}}}}]'
    return ["fit", "--config", str(CONFIG), f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", f"--trainer.callbacks={probe}"]


def _assert_finished(proc: subprocess.CompletedProcess, what: str, output: str, done: bool) -> None:
    """A zero exit; or, as launchers.torchrun allows, gloo's abort of a rank on its way out after every rank's
    work was done (``done``), which is a warning with the output, not a failure."""
    if proc.returncode != 0 and done and GLOO_EXIT_ABORT in output:
        warnings.warn(f"{what} exited with {proc.returncode} after all its work was done: {output[-1500:]}")
        return
    errors = "\n".join(line for line in output.splitlines() if "rror" in line)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{errors[-6000:]}\n{output[-3000:]}"


def _job_env(slurm_conf: Path, **extra: str) -> dict[str, str]:
    """The environment srun / sbatch pass on to the job's tasks (Slurm exports the submitter's by default)."""
    # Launcher variables an earlier in-process Trainer may have left in this process's environment.
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    return {
        **inherited,
        "SLURM_CONF": str(slurm_conf),  # the local cluster's, not a system one
        # Lightning's SLURMEnvironment would take the first node name (node1) as the rendezvous address; the
        # emulated nodes' names do not resolve, their address is this host's.
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cannot_run_local_slurm() -> str | None:
    if os.geteuid() != 0:
        return "local_cluster.sh runs slurmctld, slurmd and munged as root (and installs them with apt-get)"
    if not all(shutil.which(tool) for tool in TOOLS) and not shutil.which("apt-get"):
        return f"Slurm is not installed ({', '.join(TOOLS)}) and there is no apt-get to install it"
    return None


@pytest.fixture(scope="module")
def slurm_conf():
    """A running two-node local Slurm (its slurm.conf path); stopped, jobs first, when the module is done."""
    reason = _cannot_run_local_slurm()
    if reason:
        if os.environ.get("CI"):  # CI machines are root with apt: a skip there would hide a broken setup
            pytest.fail(reason)
        pytest.skip(reason)
    # A short path: munged's unix socket lives under it (108 bytes at most).
    cluster_dir = Path(tempfile.mkdtemp(prefix="l3d-slurm-"))
    try:
        started = time.monotonic()
        proc = subprocess.run(["bash", str(SCRIPT), "start", str(cluster_dir), "2", "4"], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"local_cluster.sh start failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        print(f"local Slurm up in {time.monotonic() - started:.1f} s")
        yield cluster_dir / "slurm.conf"
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(cluster_dir)], capture_output=True, timeout=120)
        shutil.rmtree(cluster_dir, ignore_errors=True)


@pytest.mark.multiprocess
def test_srun_task_count_that_disagrees_with_the_config_fails_on_every_rank(slurm_conf, tmp_path):
    """4 Slurm tasks for a config that asks for dp=2 x pp=2 x tp=2 = 8: one line from each task, no process
    group started (Lightning logs "Initializing distributed" as it starts one), no hang."""
    env = _job_env(slurm_conf, MASTER_PORT=str(_free_port()))
    cmd = ["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "--time=5", sys.executable, "-m", "lightning_3d",
           "fit", "--config", str(CONFIG), "--trainer.devices=2", "--trainer.num_nodes=2",
           "--trainer.strategy.init_args.data_parallel_size=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode != 0
    for rank in range(4):
        assert (f"lightning-3d: error on rank {rank}: data_parallel_size (2) * pipeline_parallel_size (2) *"
                f" tensor_parallel_size (2) = 8, but the world size is 4") in proc.stderr, proc.stderr[-3000:]
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert "ParallelConfigError" not in proc.stderr  # the name a traceback of the error would end with


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sbatch_template_trains_on_two_nodes_like_torchrun(slurm_conf, tmp_path, monkeypatch):
    """scripts/slurm/train.sbatch as a user submits it (its srun starts the tasks); `--gpus-per-node=0` drops
    its GPU request on this CPU cluster. devices and num_nodes come from the allocation (2 x 2), not from the
    config (8 x 1). Each task takes its rank from Lightning's SLURMEnvironment, sits where the layout says,
    and trains exactly as the same config started with torchrun's environment. (One Slurm job checks both:
    a second one, by srun alone, cost 53 s of the suite.)"""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    # train.sbatch derives MASTER_PORT from the job id; PYTHON: the interpreter running these tests, which may
    # be a venv's called by path (not first on PATH).
    env = _job_env(slurm_conf, PYTHON=sys.executable)
    slurm_dir = tmp_path / "slurm"
    cmd = ["sbatch", "--wait", "--gpus-per-node=0", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1",
           "--time=10", f"--output={tmp_path / 'job.out'}", str(ROOT / "scripts" / "slurm" / "train.sbatch"),
           str(CONFIG), *_overrides(slurm_dir)[3:]]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    print(f"sbatch run: {time.monotonic() - started:.1f} s")
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    _assert_finished(proc, "sbatch --wait", proc.stderr + log, done=f"max_steps={STEPS}` reached" in log)
    assert "lightning-3d: 2 nodes x 2 tasks, rendezvous 127.0.0.1:" in log
    assert "dp=1 x pp=2 x tp=2 = 4 ranks" in log
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached" in log
    by_slurm = read_ranks(slurm_dir, 4)

    dims = ParallelDims(dp=1, pp=2, tp=2)
    for rank, record in enumerate(by_slurm):
        assert record["cluster_environment"] == "SLURMEnvironment"
        assert (record["global_rank"], record["world_size"], record["layout"]) == (rank, 4, str(dims))
        assert record["env"]["SLURM_PROCID"] == str(rank)
        assert record["coords"] == dims.coords(rank)._asdict()
        assert record["env"]["SLURMD_NODENAME"] == f"node{rank // 2 + 1}"
        assert len(record["losses"]) == STEPS

    torchrun_dir = tmp_path / "torchrun"
    started = time.monotonic()
    forkrun(4, "-m", "lightning_3d", *_overrides(torchrun_dir), "--trainer.devices=4", cwd=tmp_path,
            timeout=300, rank_files=torchrun_dir)
    print(f"torchrun-style run: {time.monotonic() - started:.1f} s")
    by_torchrun = read_ranks(torchrun_dir, 4)
    assert {r["cluster_environment"] for r in by_torchrun} == {"TorchElasticEnvironment"}
    assert [r["coords"] for r in by_torchrun] == [r["coords"] for r in by_slurm]
    slurm_losses, torchrun_losses = by_slurm[0]["losses"], by_torchrun[0]["losses"]
    worst = max(abs(a - b) for a, b in zip(slurm_losses, torchrun_losses))
    print(f"losses {slurm_losses}, largest difference to torchrun {worst:.3g}")
    assert worst <= 1e-5, f"Slurm and torchrun losses differ by {worst:.3g}:\n{slurm_losses}\n{torchrun_losses}"
