"""The census' runs: every model of a layout in one launch of 2 ranks (``workers/census_worker.py``), which
goes on past a model that raises; a launch that a model brings down (a rank gone, a hang) is started again
for the models after it, so each model gets its outcome."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from helpers import WORKERS
from helpers.census.configs import tiny_config
from helpers.harness import Case, Result
from helpers.harness.launching import HEAP_ABORTS
from helpers.launchers import run_forked

LAYOUTS = {"tp2": dict(data_parallel_size=1, pipeline_parallel_size=1, tensor_parallel_size=2),
           "pp2": dict(data_parallel_size=1, pipeline_parallel_size=2, tensor_parallel_size=1, num_microbatches=2)}
"""The census' layouts, each against one process. The pipeline's 2 micro-batches are the halves of the batch
that ``hf_microbatched`` (the harness' one-process run on micro-batches) computes."""
STEPS = 3
"""Optimizer steps per run: a warm-up step at half the learning rate, then two with Adam's moments (as the
harness' ``SWEEP_STEPS``): a gradient or a reduction a layout gets wrong shows in the losses or parameters."""
WATCH = dict(setup_timeout=240.0, hang_timeout=120.0, exit_timeout=3.0)
"""The fault watch's limits (seconds): a model that hangs its ranks is stopped and reported as failed, and the
rest of the census goes on; set-up and a step of these tiny models take seconds on a loaded machine. A rank
that raises where the other does not (a pipeline stage's own error) ends the launch once the other has had
``exit_timeout`` / 2 to raise too (10 s by default, a wait each such model would add to the census)."""
LAUNCH_TIMEOUT_PER_CASE = 90.0
"""The last resort against a hang the watch does not see, per case of a launch (a case takes ~1-5 s)."""


@dataclass
class CaseError:
    """A run that raised: on which rank, what, and whether lightning_3d refused on purpose."""

    type: str
    refused: bool
    message: str
    traceback: str = ""
    rank: int | None = None


def case_for(model_type: str, layout: str) -> Case:
    """The census run of ``model_type`` under ``layout`` (a key of ``LAYOUTS``) with ``policy="auto"``."""
    kwargs = dict(LAYOUTS[layout], policy="auto", **WATCH)
    return Case(name=f"{model_type}@{layout}", module="hf", strategy_kwargs=kwargs, steps=STEPS,
                model=tiny_config(model_type), sanity_steps=0)


def run_layout(model_types: list[str], layout: str, out_dir: Path) -> dict[str, Result | CaseError]:
    """Every model of ``model_types`` under ``layout``, in as few launches of 2 ranks as its failures allow;
    the outcome by model type."""
    cases = [case_for(model_type, layout) for model_type in model_types]
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes: dict[str, Result | CaseError] = {}
    ended_in: set[str] = set()
    for attempt in range(2 * len(cases)):  # each launch settles a case, or ends in one for the first time
        remaining = [case for case in cases if case.name not in outcomes]
        if not remaining:
            break
        proc = _launch(remaining, out_dir / f"launch{attempt}")
        (out_dir / f"launch{attempt}" / "output.txt").write_text(proc.stdout + proc.stderr)
        outcomes.update(_collected(remaining, out_dir / f"launch{attempt}"))
        stuck = next((case.name for case in remaining if case.name not in outcomes), None)
        heap = next((line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(HEAP_ABORTS)), None)
        if stuck is not None and heap:  # never retried: a corrupted heap is a failure to report, not to hide
            outcomes[stuck] = CaseError(f"glibc aborted a rank on a corrupted heap: {heap}", False, _tail(proc))
        elif stuck in ended_in:
            outcomes[stuck] = CaseError("launch ended", False, _tail(proc))
        elif stuck is not None:
            # The launch ended inside this case before any rank could record it (a hang, a crash): it gets one
            # more launch, which tells a failed gloo rendezvous from the case's own end.
            ended_in.add(stuck)
    return {name.split("@")[0]: outcomes[name] for name in (case.name for case in cases)}


def _launch(cases: list[Case], folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    cases_file = folder / "cases.json"
    cases_file.write_text(json.dumps([asdict(case) for case in cases]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(WORKERS / "census_worker.py"), str(cases_file), str(folder)]
    try:
        return run_forked(2, args, env=env, timeout=60 + LAUNCH_TIMEOUT_PER_CASE * len(cases))
    except subprocess.TimeoutExpired as hung:  # the outcomes saved so far stand; the case running is reported
        return subprocess.CompletedProcess(args, -9, hung.output or "", (hung.stderr or "") + "\nlaunch timed out")


def _collected(cases: list[Case], folder: Path) -> dict[str, Result | CaseError]:
    """The outcomes the ranks saved: a Result, or the error of a rank that raised (lightning_3d's refusal first,
    then the lowest rank's)."""
    found: dict[str, Result | CaseError] = {}
    for case in cases:
        errors = sorted(folder.glob(f"{case.name}.rank*.error.json"))
        if errors:
            raised = [CaseError(**json.loads(path.read_text()), rank=int(path.name.split(".rank")[1].split(".")[0]))
                      for path in errors]
            found[case.name] = min(raised, key=lambda e: (not e.refused, e.rank))
        elif (folder / f"{case.name}.pt").exists():
            found[case.name] = torch.load(folder / f"{case.name}.pt", weights_only=False)
    return found


def _tail(proc) -> str:
    """The last lines of a launch that ended early: its errors first."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if "Error" in line or "error" in line or "hang" in line]
    return "\n".join(errors[-5:] + lines[-20:])
