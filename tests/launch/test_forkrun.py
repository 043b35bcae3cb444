"""tests/helpers/forkrun.py, the launcher of the tests' own workers (through the session's fork server, as every
``forkrun``/``launch`` call goes): each rank sees what torchrun would give it; one failing rank ends the
launch, named, instead of leaving the others waiting; a launch past its timeout is killed, every rank of it."""

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from helpers.launchers import LaunchHung, Progress, run_forked

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    out = sys.argv[1]
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"]
    dist.init_process_group("gloo")  # through the launcher's store, as under torchrun
    record = {k: os.environ.get(k) for k in keys}
    record.update(rank_zero_only=rank_zero_only.rank, main=__name__, argv=sys.argv[1:], pid=os.getpid(),
                  group_rank=dist.get_rank(), group_size=dist.get_world_size())
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(600)  # stuck outside any collective, where no peer's exit reaches it: only the launcher can end it
""")


@pytest.mark.multiprocess
def test_ranks_see_torchruns_environment_and_the_first_failure_ends_the_launch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = run_forked(3, [str(script), str(tmp_path), "extra"], env=env, timeout=240)
    seconds = time.monotonic() - started
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, record in enumerate(records):
        assert record["RANK"] == record["LOCAL_RANK"] == str(rank)
        assert (record["WORLD_SIZE"], record["LOCAL_WORLD_SIZE"], record["GROUP_RANK"]) == ("3", "3", "0")
        assert (record["group_rank"], record["group_size"]) == (rank, 3)
        assert record["rank_zero_only"] == rank  # Lightning's rank-zero filter, as if imported in this rank
        assert record["main"] == "__main__" and record["argv"] == [str(tmp_path), "extra"]
    assert len({r["pid"] for r in records}) == 3 and records[0]["TORCHELASTIC_RUN_ID"]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "ValueError: rank 1 fails on purpose" in proc.stderr, proc.stderr[-3000:]
    assert "forkrun: rank 1 " in proc.stderr and "stopping ranks [0, 2]" in proc.stderr, proc.stderr[-3000:]
    assert seconds < 120, f"the launch took {seconds:.0f} s to end after rank 1 failed"
    _assert_gone([r["pid"] for r in records])


@pytest.mark.multiprocess
def test_a_launch_hung_past_its_timeout_is_killed_with_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(Progress, "STALL_S", 3.0)  # the sleepers use no CPU: hung once past the timeout
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "open(os.path.join(sys.argv[1], f\"pid{os.environ['RANK']}\"), 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with pytest.raises(LaunchHung, match="hung"):
        run_forked(2, [str(script), str(tmp_path)], env=env, timeout=8)  # a fork and a file write take well under 1 s
    _assert_gone([int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)])


def _assert_gone(pids: list[int]) -> None:
    for rank, pid in enumerate(pids):
        for _ in range(100):  # SIGKILL is delivered at once; freeing a rank's memory takes a moment
            if _state(pid) in ("gone", "Z"):
                break
            time.sleep(0.1)
        assert _state(pid) in ("gone", "Z"), f"rank {rank} still runs ({_state(pid)}) after its launch ended"


def _state(pid: int) -> str:
    """The process's state letter (R running, S sleeping, Z exited, not yet reaped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
