"""``lightning-3d plan --compile``: the config it writes compiles the blocks, and the report says that the
step times do not model torch.compile (its speed is assumed, not estimated)."""

from pathlib import Path

import yaml

from lightning_3d.cli import main
from lightning_3d.planner.time import COMPILE_ASSUMED

FIT_CONFIG = str(Path(__file__).parents[2] / "example_configs/gpt_1b_8gpu.yaml")


def _plan(capsys, tmp_path, *flags):
    out = tmp_path / "plan.yaml"
    main(["plan", "--fit-config", FIT_CONFIG, "--gpu", "h100", "--global-batch-size", "32", "--top", "1",
          "--yaml-out", str(out), *flags])
    return capsys.readouterr().out, out.read_text()


def test_plan_with_compile_writes_compile_and_says_its_speed_is_assumed(capsys, tmp_path):
    printed, written = _plan(capsys, tmp_path, "--compile")
    assert COMPILE_ASSUMED in printed and COMPILE_ASSUMED in written
    assert yaml.safe_load(written)["trainer"]["strategy"]["init_args"]["compile"] is True


def test_plan_without_compile_leaves_it_out(capsys, tmp_path):
    printed, written = _plan(capsys, tmp_path)
    assert COMPILE_ASSUMED not in printed and "compile" not in yaml.safe_load(written)["trainer"]["strategy"]["init_args"]
