"""``benchmarks/gpu_check.py --cpu-smoke``: the prepared GPU check runs every part on CPU, so that the day a GPU
is lent it does not fail on code that rotted; and a part that fails (here: one past its timeout) makes the line
FAIL, the exit status 1 and the report say so."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"
PART_NAMES = ("compile", "tp", "init_meta", "init_exact", "init_fast", "checkpoint", "layout")


def _gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _part_lines(stdout: str) -> dict[str, str]:
    """The last PASS / FAIL line of each part (the summary repeats them)."""
    lines = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL"):
            lines[rest.split(" ", 1)[0]] = status
    return lines


@pytest.mark.timeout(900)
def test_every_part_passes_on_cpu_and_writes_the_report(tmp_path):
    report = tmp_path / "report.json"
    # Three times the parts' limits: inductor's compile on two loaded cores can pass 120 s, and a part's limit is
    # for a hang, not for a slow host.
    proc = _gpu_check("--report", str(report), "--timeout-scale", "3", timeout=840)
    output = proc.stdout + proc.stderr
    assert _part_lines(proc.stdout) == dict.fromkeys(PART_NAMES, "PASS"), output[-6000:]
    assert proc.returncode == 0, output[-6000:]
    written = json.loads(report.read_text())
    assert written["cpu_smoke"] is True
    assert {name: part["status"] for name, part in written["parts"].items()} == dict.fromkeys(PART_NAMES, "PASS")
    for part in written["parts"].values():
        assert part["checks"] and part["judged"], part  # every part judged something on CPU too
    assert "multi-rank NCCL" in proc.stdout and written["not_proven"]  # what one GPU cannot prove, said


def test_a_part_past_its_timeout_fails_the_check(tmp_path):
    report = tmp_path / "report.json"
    # A timeout of 0 s: the runner stops waiting at once and kills the part's process, whatever its speed.
    proc = _gpu_check("--parts", "tp", "--timeout-scale", "0", "--report", str(report), timeout=300)
    assert _part_lines(proc.stdout) == {"tp": "FAIL"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "timed out after 0 s" in proc.stdout
    assert proc.returncode == 1
    assert json.loads(report.read_text())["parts"]["tp"]["status"] == "FAIL"
