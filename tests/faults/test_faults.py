"""Never hang, never fail silently (lightning_3d.faults): a rank that raises takes every rank down within
the exit timeout with its name, coordinates and exception; a hang ends with every rank's report of what it
waits in. Each case is one launch that is meant to fail: forked from the tests' fork server, except one failing
rank under real torchrun (its "Root Cause" summary names our failure) and the restart (torchrun's own)."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import WORKERS
from helpers.launchers import run_forked, run_to_end
from lightning_3d.faults.watch import FaultWatch, Phase

WORKER = str(WORKERS / "faults_worker.py")


def _launch_failing(tmp_path: Path, where: str, rank: int, layout: tuple[int, int, int],
                    launcher: str = "torchrun") -> tuple[str, float]:
    """Run the job under ``launcher``: torchrun, or ``forkrun`` (the ranks forked from the tests' fork server,
    with torchrun's environment but not its agent: no error file, no "Root Cause" summary; it spares each rank
    the imports of a fresh interpreter). Returns the launch's stderr and the seconds from the injected fault to
    the job's end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nprocs = layout[0] * layout[1] * layout[2]
    args = [WORKER, str(tmp_path), where, str(rank), ",".join(map(str, layout))]
    if launcher == "forkrun":
        proc = run_forked(nprocs, args, env=env, timeout=240)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", *args]
        proc = run_to_end(cmd, env=env, timeout=240)
    ended = time.time()
    assert proc.returncode != 0, "the job was meant to fail"
    ours = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("lightning_3d:"))
    assert (tmp_path / "fault_time").exists(), f"the job ended before the injected fault:\n{ours}"
    fault_time = float((tmp_path / "fault_time").read_text())
    return proc.stderr, ended - fault_time


def _coords(rank: int, layout: tuple[int, int, int]) -> str:
    dp, pp, tp = layout
    return f"rank {rank} (dp={rank // tp % dp}, pp={rank // (tp * dp)}, tp={rank % tp})"


@pytest.mark.multiprocess
@pytest.mark.parametrize("where, rank, layout, launcher", [
    ("forward", 5, (2, 2, 2), "forkrun"),
    ("backward", 1, (1, 2, 1), "torchrun"),  # torchrun's own summary: its root cause names our failure
    ("optimizer", 1, (2, 1, 1), "forkrun"),
    ("callback", 0, (1, 1, 2), "forkrun"),
    ("dataloader", 1, (2, 1, 1), "forkrun"),
])
def test_one_failing_rank_takes_the_job_down_naming_itself(tmp_path, where, rank, layout, launcher):
    stderr, seconds = _launch_failing(tmp_path, where, rank, layout, launcher)
    failed = f"{_coords(rank, layout)} failed: ValueError: injected failure in {where}"
    assert f"lightning_3d: {failed}" in stderr, stderr[-3000:]
    for other in set(range(layout[0] * layout[1] * layout[2])) - {rank}:
        assert f"lightning_3d: {_coords(other, layout)} stops: {failed}" in stderr, (other, stderr[-3000:])
    if launcher == "torchrun":
        # torchrun's root cause is the failing rank (its traceback) or a rank stopped in the same second (its
        # error file says which rank failed and why): either way it names the injected exception.
        assert f"injected failure in {where}" in stderr.split("Root Cause (first observed failure):")[1], stderr[-3000:]
    assert seconds < 5 + 10, f"the job took {seconds:.1f} s to end after the failure (exit_timeout=5)"
    print(f"[faults] {where}: job ended {seconds:.1f} s after the failure")


@pytest.mark.multiprocess
def test_a_hang_ends_the_job_with_what_every_rank_waits_in(tmp_path):
    layout = (1, 2, 2)  # rank 1 (stage 0, tp 1) sleeps in training_step; its tp peer and stage 1 wait for it
    stderr, seconds = _launch_failing(tmp_path, "hang", 1, layout, "forkrun")
    reports = {rank: stderr.split(f"lightning_3d: {_coords(rank, layout)} made no progress for")[1][:1500]
               for rank in range(4) if f"lightning_3d: {_coords(rank, layout)} made no progress for" in stderr}
    assert sorted(reports) == [0, 1, 2, 3], stderr[-4000:]
    assert "time.sleep(0.05)" in stderr  # only the sleeping rank's stack has the line it sleeps on
    assert "waiting in: wait_tensor" in reports[0] and "stage 0 forward of micro-batch 0" in reports[0], reports[0]
    for rank in (2, 3):  # the next stage waits for activations
        assert "waiting in: _wait_batch_p2p" in reports[rank], reports[rank]
    assert seconds < 15 + 15 + 10, f"the hang took {seconds:.1f} s to end the job (hang_timeout=15, exit_timeout=15)"
    print(f"[faults] hang: job ended {seconds:.1f} s after the rank stopped")


@pytest.mark.multiprocess
def test_slow_set_up_and_checkpoints_are_not_hangs_but_a_slow_step_is_reported_with_its_phase(tmp_path):
    # Rank 1 builds its model, saves a checkpoint and, in a second fit, loads it, each 4.5 s > hang_timeout
    # (3 s), with no limit of their own (setup_timeout and checkpoint_timeout are None); then hangs in a step.
    layout = (2, 1, 1)
    stderr, seconds = _launch_failing(tmp_path, "slow_phases", 1, layout, "forkrun")
    assert all((tmp_path / f"slow_{name}").exists() for name in ("configure_model", "save", "load")), stderr[-3000:]
    reports = re.findall(r"^lightning_3d: (rank \d .*) made no progress for [\d.]+ s in (.*)$", stderr, re.M)
    assert sorted(who for who, _ in reports) == [_coords(0, layout), _coords(1, layout)], stderr[-3000:]
    assert all(phase.startswith('phase "training"') for _, phase in reports), reports  # not set-up, not a checkpoint
    report = stderr.split(f"lightning_3d: {_coords(1, layout)} made no progress for")[1][:300]
    assert 'in phase "training" (hang_timeout: 3 s; last: training_step started)' in report, report
    assert "time.sleep(0.05)" in stderr
    assert seconds < 3 + 5 + 10, f"the hang took {seconds:.1f} s to end the job (hang_timeout=3)"
    print(f"[faults] slow phases, then a hang: job ended {seconds:.1f} s after the rank stopped")


@pytest.mark.multiprocess
def test_a_job_restarted_by_torchrun_resumes_from_its_newest_checkpoint_with_the_same_losses(tmp_path):
    from helpers.harness import Case, reference_for

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1", "--nproc-per-node=2",
           str(WORKERS / "restart_worker.py"), str(tmp_path)]
    proc = run_to_end(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "losses_rank0.jsonl").read_text().splitlines()]
    first = [r for r in records if r["attempt"] == 0]
    second = [r for r in records if r["attempt"] == 1]
    # Killed at the start of step 5; the newest checkpoint is step 3: the restart redoes steps 4 and 5 (the
    # steps since that checkpoint), and no step is skipped.
    assert [r["step"] for r in first] == [1, 2, 3, 4] and [r["step"] for r in second] == [4, 5, 6, 7, 8]
    assert second[0]["loss"] == first[3]["loss"]  # step 4 again, bit for bit
    reference = reference_for(Case(name="reference", model=dict(n_layer=2, n_embd=32, n_head=4, block_size=16),
                                   steps=8))
    losses = [r["loss"] for r in first[:3] + second]
    assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 1e-5, (losses, reference.losses)


class GlitchingStore(dist.Store):
    """An in-memory store whose reads fail for its first ``down_s`` seconds, as a network store does while its
    host is briefly unreachable."""

    def __init__(self, down_s: float) -> None:
        super().__init__()
        self.inner, self.up_at = dist.HashStore(), time.monotonic() + down_s

    def _glitch(self) -> None:
        if time.monotonic() < self.up_at:
            raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        self._glitch()
        return self.inner.check(keys)

    def get(self, key):
        self._glitch()
        return self.inner.get(key)

    def set(self, key, value):
        self.inner.set(key, value)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_failing_fault_store_is_reported_once_and_a_failure_published_after_it_recovers_is_seen(capfd):
    store = GlitchingStore(down_s=0.5)  # 5 polls of 0.1 s
    rank0 = FaultWatch(store, 0, 2, lambda r: f"rank {r}", Phase("training", None), exit_timeout_s=0.8)
    exits = []
    rank0._exit = lambda report, printed=False: exits.append(report)  # instead of ending this process
    rank0.start()
    try:
        _wait_for(lambda: time.monotonic() > store.up_at + 0.3)
        rank1 = FaultWatch(store, 1, 2, lambda r: f"rank {r}", Phase("training", None), exit_timeout_s=0.8)
        rank1.store = rank0.store  # the same generation's keys (one watch per process in a real run)
        rank1.announce_failure(ValueError("injected after the glitch"))
        _wait_for(lambda: exits, seconds=5)
    finally:
        rank0.stop()
    stderr = capfd.readouterr().err
    assert exits == ["rank 0 stops: rank 1 failed: ValueError: injected after the glitch"], stderr
    assert stderr.count("rank 0 cannot read the fault store (RuntimeError: Connection reset by peer)") == 1, stderr
    assert "rank 0 reads the fault store again" in stderr, stderr


def test_no_rank_ends_after_a_hang_before_every_rank_has_printed_its_report():
    # torchrun ends every rank once one exits, so a rank that is slow to notice the hang (rank 2 here, whose
    # watcher has not started) would lose its report if a peer exited as soon as it had printed its own.
    store = dist.HashStore()
    watches = [FaultWatch(store, rank, 3, lambda r: f"rank {r}", Phase("training", 0.3 if rank == 0 else None),
                          exit_timeout_s=8.0) for rank in range(3)]
    exits = {}
    for watch in watches:
        watch.store = watches[0].store  # the same generation's keys (one watch per process in a real run)
        watch._exit = lambda report, printed=False, rank=watch.rank: exits.setdefault(rank, time.monotonic())
    for watch in watches[:2]:
        watch.start()
    try:
        _wait_for(lambda: watches[0].store.add("acks", 0) >= 2, seconds=5)
        time.sleep(1.0)  # ranks 0 and 1 have printed and acknowledged; rank 2 has not yet
        assert exits == {}, "a rank ended before the slow rank had printed what it waits in"
        slow_started = time.monotonic()
        watches[2].start()
        _wait_for(lambda: len(exits) == 3)
    finally:
        for watch in watches:
            watch.stop()
    assert sorted(exits) == [0, 1, 2] and min(exits.values()) >= slow_started, exits


class WritesPerFlush:
    """A stderr that keeps what each flush sends on as one write (what a pipe receives from this process)."""

    def __init__(self) -> None:
        self.pending, self.writes = "", []

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.writes.append(self.pending)
        self.pending = ""


def test_a_hang_report_is_written_one_line_per_write(monkeypatch):
    # The ranks share one stderr. A report of several KiB in one write was cut by the pipe, and the other rank's
    # report began inside one of its lines: "made no progress" not at a line's start, one report of two found.
    stderr = WritesPerFlush()
    monkeypatch.setattr(sys, "stderr", stderr)
    watch = FaultWatch(dist.HashStore(), 0, 1, lambda r: f"rank {r}", Phase("training", 1.0, "hang_timeout"),
                       exit_timeout_s=1.0)
    exits = []
    watch._exit = lambda report, printed=False: exits.append(report)  # instead of ending this process
    watch._report_hang(None, 1.5, watch.phase, "training_step started", store_ok=True)
    assert exits and stderr.writes[0].startswith("lightning_3d: rank 0 made no progress for 1.5 s"), stderr.writes
    assert len(stderr.writes) > 3 and all(w.endswith("\n") and w.count("\n") == 1 for w in stderr.writes), stderr.writes
