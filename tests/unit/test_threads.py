"""Intra-op threads per rank (``strategies/threads.py``): a count the user set is kept; anything else in
OMP_NUM_THREADS is not a count, and each rank gets its share of the host's CPUs as if it were unset."""

import os
import subprocess
import sys

import pytest
import torch

from lightning_3d.strategies import threads


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", ""))  # restored after the test
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["", " ", "0", "-2", "four"])
def test_an_omp_num_threads_that_is_not_a_count_leaves_the_share_to_the_strategy(value, monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "_OMP_AT_IMPORT", value)
    monkeypatch.setattr(threads, "_THREADS_AT_IMPORT", torch.get_num_threads())
    share = threads.threads_per_rank(2)
    assert threads.set_threads_per_rank(2) == share
    assert torch.get_num_threads() == share
    assert os.environ["OMP_NUM_THREADS"] == str(share)


def test_a_count_in_omp_num_threads_is_the_users(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "_OMP_AT_IMPORT", "3")
    monkeypatch.setattr(threads, "_THREADS_AT_IMPORT", torch.get_num_threads())
    before = torch.get_num_threads()
    assert threads.set_threads_per_rank(2) is None
    assert torch.get_num_threads() == before


def test_an_empty_omp_num_threads_as_a_job_script_exports_it_splits_the_cpus():
    """``export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK`` without ``--cpus-per-task``: torch ignores the empty value
    and runs one thread per CPU in every rank, and torchrun keeps it (it fills in only an unset variable).
    Read at import, in a process of its own, as a rank reads it."""
    code = ("import torch; from lightning_3d.strategies.threads import set_threads_per_rank, threads_per_rank;"
            " print(torch.get_num_threads(), set_threads_per_rank(2), torch.get_num_threads(), threads_per_rank(2))")
    env = {**os.environ, "OMP_NUM_THREADS": ""}
    env.pop("LOCAL_WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    at_start, set_to, after, share = map(int, out.stdout.split()[-4:])
    assert at_start >= share  # torch ran its default for the empty value (one thread per CPU or core)
    assert set_to == after == share
