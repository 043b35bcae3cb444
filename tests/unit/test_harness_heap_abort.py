"""The parity harness gives cases a second launch when glibc aborted a rank on a corrupted heap (a rare abort
inside torch/gloo, helpers/harness/launching.py HEAP_ABORTS), and only then; a second such abort fails."""

import subprocess
import warnings

import pytest
import torch

from helpers.harness import Case, Result
from helpers.harness import launching


def _fake_runs(monkeypatch, outcomes):
    """run_forked replaced: each call takes the next outcome -- "abort" (glibc's line, no result), "ok" (every
    case's result written), or "crash" (another failure, no result)."""
    calls = []

    def run_forked(nprocs, args, env, timeout):
        cases_file, out_dir = args[1], args[2]
        outcome = outcomes[len(calls)]
        calls.append(out_dir)
        if outcome == "ok":
            import json
            from pathlib import Path
            for raw in json.loads(Path(cases_file).read_text()):
                torch.save(Result([1.0], {}), Path(out_dir) / f"{raw['name']}.pt")
        stderr = {"abort": "malloc(): unaligned tcache chunk detected\n", "crash": "RuntimeError: boom\n"}.get(outcome, "")
        return subprocess.CompletedProcess(args, 0 if outcome == "ok" else -6, stdout="", stderr=stderr)

    monkeypatch.setattr(launching, "run_forked", run_forked)
    return calls


def test_a_heap_abort_gets_the_unfinished_cases_one_more_launch_with_a_warning(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, ["abort", "ok"])
    with pytest.warns(UserWarning, match="glibc aborted a rank on a corrupted heap"):
        results = launching.launch([Case(name="a"), Case(name="b")], 2, tmp_path)
    assert sorted(results) == ["a", "b"] and len(calls) == 2


@pytest.mark.parametrize("outcomes", [["abort", "abort"], ["crash"]])
def test_a_second_heap_abort_or_any_other_crash_fails(monkeypatch, tmp_path, outcomes):
    _fake_runs(monkeypatch, outcomes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError, match="failed"):
            launching.launch([Case(name="a")], 2, tmp_path)
