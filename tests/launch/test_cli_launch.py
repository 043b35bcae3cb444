"""The ``lightning-3d`` console script starting ranks: each CPU example config trains a few steps under
Lightning's launcher, torchrun starts it, a world that disagrees with the config fails on every rank, and a
newcomer's run with nothing set splits the CPUs and prints each line once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launchers import forkrun, run_to_end, torchrun

ROOT = Path(__file__).parents[2]


def _cli(*args, timeout=300, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lightning_3d", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, layout, overrides", [
    # gpt_tiny_dp_cpu.yaml: test_a_run_without_a_thread_count_... (one launch checks both)
    ("gpt_tiny_tp_cpu.yaml", "dp=2 x pp=1 x tp=2 = 4 ranks", []),
    ("gpt_tiny_3d_cpu.yaml", "dp=2 x pp=2 x tp=2 = 8 ranks", []),
    ("gpt_tiny_zero_cpu.yaml", "dp=2 x pp=1 x tp=2 = 4 ranks", []),
    # The Hugging Face Llama on 4 of its 8 ranks (dp=1): the CLI path is the same, the suite shorter.
    ("llama_tiny_3d_cpu.yaml", "dp=1 x pp=2 x tp=2 = 4 ranks",
     ["--trainer.devices=4", "--trainer.strategy.init_args.data_parallel_size=1"]),
])
def test_cpu_config_trains_a_few_steps_with_the_3d_strategy(tmp_path, name, layout, overrides):
    """Each CPU example config trains through the console script's code. The README's demo config
    (gpt_tiny_3d_cpu.yaml) runs as the README says, its 8 ranks started by Lightning's launcher; the others
    run the same ``python -m lightning_3d fit`` in ranks forked from the tests' fork server
    (tests/helpers/forkrun.py: torchrun's environment, so Lightning starts no processes of its own), which
    spares each of their ranks the imports of a fresh interpreter (~8 CPU seconds each): the three took
    121 s, now 42 s."""
    if name.startswith("llama"):
        pytest.importorskip("transformers")
    config = ROOT / "example_configs" / name
    args = ("fit", "--config", str(config), "--trainer.max_steps=4", "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), *overrides)
    if name == "gpt_tiny_3d_cpu.yaml":
        proc = _cli(*args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:
        ranks = int(layout.split("= ")[1].split()[0])
        proc = forkrun(ranks, "-m", "lightning_3d", *args, cwd=tmp_path)
    assert layout in proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=4` reached" in proc.stdout + proc.stderr
    assert "lightning_3d: memory per rank (MiB, min-max over" in proc.stdout + proc.stderr  # once, after step 1
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*")), "no TensorBoard event file written"


@pytest.mark.multiprocess
def test_torchrun_starts_the_cli(tmp_path):
    """`torchrun -m lightning_3d fit ...`: the processes come from torchrun (Lightning's torchelastic
    environment), not from Lightning's launcher."""
    config = ROOT / "example_configs" / "gpt_tiny_dp_cpu.yaml"
    proc = torchrun(2, "-m", "lightning_3d", "fit", "--config", str(config), "--trainer.max_steps=3",
                    "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                    "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), cwd=tmp_path)
    assert "dp=2 x pp=1 x tp=1 = 2 ranks" in proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_torchrun_world_that_disagrees_with_the_config_fails_on_every_rank_before_any_collective(tmp_path):
    """4 processes for a config that asks for dp=2 x pp=2 x tp=2 = 8: each rank says so in one line and
    exits, without a traceback and before the process group exists (so no rank can wait for another)."""
    config = ROOT / "example_configs" / "gpt_tiny_3d_cpu.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # torchrun stops the other ranks once it sees one fail; checking every 5 s instead of 0.1 s lets each
    # rank reach the check and report on its own, as each would on a cluster.
    proc = run_to_end([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                       "--monitor-interval=5", "-m", "lightning_3d", "fit", "--config", str(config),
                       "--trainer.devices=4", "--trainer.strategy.init_args.data_parallel_size=2"],
                      env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    for rank in range(4):
        assert (f"lightning-3d: error on rank {rank}: data_parallel_size (2) * pipeline_parallel_size (2) *"
                f" tensor_parallel_size (2) = 8, but the world size is 4") in proc.stderr, proc.stderr[-3000:]
    assert "Set data_parallel_size='auto' (-> 1)" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # Lightning's line as the group starts
    assert "ParallelConfigError" not in proc.stderr  # the name a traceback of the error would end with


# ---------------------------------------------------------------------------------------------- a newcomer's run


@pytest.mark.multiprocess
def test_a_run_without_a_thread_count_splits_the_cpus_and_prints_each_line_once(tmp_path):
    """The README's way in, with nothing set (issue 18): no OMP_NUM_THREADS, Lightning's launcher, 2 ranks
    (gpt_tiny_dp_cpu.yaml, checked here as the other example configs are in the test above).
    Each rank gets its share of the CPUs (torch's default is all of them, per rank); Lightning's own pytree
    deprecation warning and its per-rank set-up lines do not repeat per rank; the bar counts steps."""
    from helpers.warning_filters import _our_modules

    config = ROOT / "example_configs" / "gpt_tiny_dp_cpu.yaml"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    # Our warnings still fail the run; the third-party ones the tests ignore (warning_filters.IGNORED) show.
    env["PYTHONWARNINGS"] = ",".join(f"error::Warning:{name}" for name in _our_modules())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    # The same settings as test_cpu_config_trains_a_few_steps_with_the_3d_strategy gives the other configs.
    proc = run_to_end([sys.executable, "-m", "lightning_3d", "fit", "--config", str(config), "--trainer.max_steps=4",
                       "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
                       "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
                       "--trainer.callbacks+=helpers.cli_probe.RankProbe", f"--trainer.callbacks.out_dir={tmp_path}"],
                      env=env, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    from helpers.cli_probe import read_ranks

    share = max(1, len(os.sched_getaffinity(0)) // 2)
    threads = [r["intra_op_threads"] for r in read_ranks(tmp_path, 2)]
    problems = [  # all of them at once: one launch checks four things
        *([f"intra-op threads per rank {threads}, expected {[share, share]}"] if threads != [share, share] else []),
        *(["the thread count was not logged once"]
          if out.count(f"lightning_3d: {share} intra-op thread(s) per rank") != 1 else []),
        *(["Lightning's LeafSpec warning shown"] if "LeafSpec" in out else []),
        *(["rank 1's set-up lines shown"] if "GLOBAL_RANK: 1" in out or "[rank: 1] Seed set to" in out else []),
        *(["rank 0's set-up line missing"] if "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" not in out else []),
        *(["the progress bar does not count steps"] if "step 4/4" not in out or "/-4" in out else []),
        # What the config test checks of every example config.
        *(["no layout line"] if "dp=2 x pp=1 x tp=1 = 2 ranks" not in out else []),
        *(["max_steps not reached"] if "`Trainer.fit` stopped: `max_steps=4` reached" not in out else []),
        *(["no memory line"] if "lightning_3d: memory per rank (MiB, min-max over" not in out else []),
        *(["no TensorBoard event file"] if not list((tmp_path / "logs").rglob("events.out.tfevents.*")) else []),
    ]
    assert not problems, (problems, out[-4000:])
