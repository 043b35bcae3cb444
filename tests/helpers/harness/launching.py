"""Cases launched on N ranks (forked: ``launchers.run_forked``), many cases per launch, results back by name."""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from helpers import WORKERS
from helpers.harness.cases import Case, Result
from helpers.launchers import run_forked


HEAP_ABORTS = ("malloc(): ", "free(): ", "double free or corruption", "corrupted size vs. prev_size")
"""glibc's words when it aborts a process on a corrupted heap (seen in a few suite runs on loaded hosts, e.g.
"malloc(): unaligned tcache chunk detected" in a 4-rank ZeRO-3 + sequence-parallel case; cause unknown, see
issue 55). A launch that prints one fails, quoting it: launching again would hide it."""


def launch(cases: list[Case], nprocs: int, out_dir: Path, timeout: float = 600) -> dict[str, Result]:
    """Run ``cases`` one after another in one launch of ``nprocs`` ranks (gloo; forked, :func:`forkrun`);
    results by name.

    A hang (``launchers.Progress``: past ``timeout`` seconds and no progress) or a crash fails with the ranks'
    output, never silently; so does a rank that glibc aborted on a corrupted heap (``HEAP_ABORTS``), whenever
    it happened. A non-zero exit after every case has saved its result (once seen: a rank dying at interpreter
    exit, after the last case) is reported as a warning with the output, not as a failure of the cases."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cases_file = out_dir / "cases.json"
    cases_file.write_text(json.dumps([asdict(c) for c in cases]))
    args = [str(WORKERS / "parity_worker.py"), str(cases_file), str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = run_forked(nprocs, args, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-4000:] if isinstance(err.stdout, bytes) else (err.stdout or "")[-4000:]
        raise AssertionError(f"launch of {nprocs} ranks hung ({getattr(err, 'why', f'timeout {timeout}s')}):\n{tail}") from err
    missing = [c.name for c in cases if not (out_dir / f"{c.name}.pt").exists()]
    heap = next((line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(HEAP_ABORTS)), None)
    if heap:
        raise AssertionError(f"launch of {nprocs} ranks: glibc aborted a rank on a corrupted heap ({heap!r};"
                             f" exit {proc.returncode}, cases without a result: {missing}):\n{proc.stderr[-4000:]}")
    if proc.returncode != 0 and missing:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        raise AssertionError(f"launch of {nprocs} ranks failed ({proc.returncode}) before {missing}:\n"
                             f"{proc.stdout[-2000:]}\n" + "\n".join(errors[-40:]) + "\n" + proc.stderr[-4000:])
    if proc.returncode != 0:  # every case finished and was saved; a rank then died on its way out
        warnings.warn(f"launch of {nprocs} ranks exited with {proc.returncode} after saving every result:"
                      f" {proc.stderr[-1500:]}")
    return {c.name: torch.load(out_dir / f"{c.name}.pt", weights_only=False) for c in cases}


def launch_by_world_size(cases: list[Case], out_dir: Path, timeout: float = 900) -> dict[str, Result]:
    """Every ``3d`` case, in one launch per world size (dp * pp * tp), smallest first; results by name."""

    def world(case: Case) -> int:
        k = case.strategy_kwargs
        return k["data_parallel_size"] * k["pipeline_parallel_size"] * k["tensor_parallel_size"]

    found: dict[str, Result] = {}
    for size in sorted({world(c) for c in cases}):
        found.update(launch([c for c in cases if world(c) == size], size, out_dir / f"world{size}", timeout))
    return found
