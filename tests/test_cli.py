"""The ``lightning-3d`` console script: example configs parse, interpolate and run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness import torchrun

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "example_configs").glob("*.yaml"))


def _cli(*args, timeout=300, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "lightning_3d", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_example_config_prints_a_complete_resolved_config(config):
    proc = _cli("fit", "--config", str(config), "--print_config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_3d.ThreeDStrategy"
    # omegaconf interpolation resolved: the data's vocabulary is the model's
    assert printed["data"]["init_args"]["vocab_size"] == printed["model"]["init_args"]["config"]["vocab_size"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, layout", [("gpt_tiny_dp_cpu.yaml", "dp=2 x pp=1 x tp=1 = 2 ranks"),
                                          ("gpt_tiny_tp_cpu.yaml", "dp=2 x pp=1 x tp=2 = 4 ranks"),
                                          ("gpt_tiny_3d_cpu.yaml", "dp=2 x pp=2 x tp=2 = 8 ranks"),
                                          ("gpt_tiny_zero_cpu.yaml", "dp=2 x pp=1 x tp=2 = 4 ranks")])
def test_cpu_config_trains_a_few_steps_with_the_3d_strategy(tmp_path, name, layout):
    config = ROOT / "example_configs" / name
    proc = _cli("fit", "--config", str(config), "--trainer.max_steps=4", "--trainer.val_check_interval=2",
                "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert layout in proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=4` reached" in proc.stdout + proc.stderr
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*")), "no TensorBoard event file written"


def test_strategy_can_be_given_by_its_registered_name():
    config = ROOT / "example_configs" / "gpt_tiny_dp_cpu.yaml"
    proc = _cli("fit", "--config", str(config), "--trainer.strategy=3d", "--print_config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert yaml.safe_load(proc.stdout)["trainer"]["strategy"] == "3d"


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
