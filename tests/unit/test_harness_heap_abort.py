"""The parity harness fails a launch in which glibc aborted a rank on a corrupted heap (helpers/harness/
launching.py HEAP_ABORTS), quoting glibc's line, even when every case saved its result: a second launch would
hide the corruption (issue 55)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.harness import Case, Result
from helpers.harness import launching


def _fake_runs(monkeypatch, outcomes):
    """run_forked replaced: each call takes the next outcome -- "abort" (glibc's line, no result), "late abort"
    (every case's result written, then glibc's line), "ok" (every result written), "crash" (another failure)."""
    calls = []

    def run_forked(nprocs, args, env, timeout):
        cases_file, out_dir = args[1], args[2]
        outcome = outcomes[len(calls)]
        calls.append(out_dir)
        if outcome in ("ok", "late abort"):
            for raw in json.loads(Path(cases_file).read_text()):
                torch.save(Result([1.0], {}), Path(out_dir) / f"{raw['name']}.pt")
        stderr = {"crash": "RuntimeError: boom\n", "ok": ""}.get(outcome, "malloc(): unaligned tcache chunk detected\n")
        return subprocess.CompletedProcess(args, 0 if outcome == "ok" else -6, stdout="", stderr=stderr)

    monkeypatch.setattr(launching, "run_forked", run_forked)
    return calls


@pytest.mark.parametrize("outcome", ["abort", "late abort"])
def test_a_heap_abort_fails_the_launch_with_glibcs_line_and_is_not_launched_again(monkeypatch, tmp_path, outcome):
    calls = _fake_runs(monkeypatch, [outcome, "ok"])
    with pytest.raises(AssertionError, match="glibc aborted a rank on a corrupted heap.*unaligned tcache chunk"):
        launching.launch([Case(name="a"), Case(name="b")], 2, tmp_path)
    assert len(calls) == 1


def test_any_other_crash_fails_and_a_clean_launch_gives_every_result(monkeypatch, tmp_path):
    _fake_runs(monkeypatch, ["crash", "ok"])
    with pytest.raises(AssertionError, match="failed"):
        launching.launch([Case(name="a")], 2, tmp_path / "crash")
    assert sorted(launching.launch([Case(name="a"), Case(name="b")], 2, tmp_path / "ok")) == ["a", "b"]
