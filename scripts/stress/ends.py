"""Stress the ends of runs: many short launches of 4 ranks, with CPU hogs beside them, and every one must end
as it should (issue 55).

    python scripts/stress/ends.py --repeats 50 --hogs 2 [--launcher torchrun|ranks] [--minutes M]
        [--kinds fit,fit_async,validate,raise] [--out DIR]

Each launch runs ``ends_worker.py KIND`` (plain fit; fit with ``async_checkpoint=True``; validate only; a fit
whose rank 2 raises), under torchrun or (``--launcher ranks``) as srun starts ranks: one process each, rank 0
hosting the store. A launch passes when its exit codes are the expected ones (0, or non-zero for ``raise``,
whose failing rank must be named), every rank that should finish did, no rank printed C++'s ``terminate
called`` or a glibc heap abort, none died of a signal, and no process of the launch outlives it. Prints one
line per launch and a summary per kind; exits 1 if any launch failed. Launches run one after another, the
kinds interleaved, so a slow period of the host is shared by all of them; ``--minutes`` starts no new round
after that long."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

WORKER = Path(__file__).with_name("ends_worker.py")
KINDS = ("fit", "fit_async", "validate", "raise")
NPROCS = 4
ABORTS = ("terminate called", "malloc(): ", "free(): ", "double free or corruption", "corrupted size vs. prev_size",
          "Fatal Python error", "Segmentation fault")
# torchrun's summary line for a rank that a signal ended ("exitcode  : -6 (pid: ...)"); SIGTERM/SIGKILL are
# torchrun's own way of ending the other ranks once one has failed.
SIGNALLED = re.compile(r"exitcode\s*:\s*-(\d+)")


def hog() -> subprocess.Popen:
    """A busy loop on one core, in a process of its own."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def launch(kind: str, out: Path, timeout: float, launcher: str) -> tuple[list[str], float]:
    """One launch; returns what went wrong (empty: it ended as it should) and its seconds."""
    out.mkdir(parents=True)
    started = time.monotonic()
    codes, output, problems = run_ranks(kind, out, timeout) if launcher == "ranks" else run_torchrun(kind, out, timeout)
    seconds = time.monotonic() - started
    (out / "output.txt").write_text(output)
    done = sorted(int(p.stem[4:]) for p in out.glob("rank*.done"))
    if kind == "raise":
        if not any(codes):
            problems.append("exit code 0 although rank 2 raised")
        if "failed: ValueError: injected failure" not in output:
            problems.append("the failing rank is not named")
    else:
        if any(codes):
            problems.append(f"exit codes {codes}")
        if done != list(range(NPROCS)):
            problems.append(f"ranks done: {done}")
    problems += [f"printed {word!r}" for word in ABORTS if word in output]
    # Signals: ours ended by one (a negative code); torchrun's summary names its ranks' ("exitcode : -6").
    # SIGTERM and SIGKILL are torchrun's way of ending the other ranks once one has failed.
    signals = {-code for code in codes if code < 0} | {int(s) for s in SIGNALLED.findall(output)}
    signals -= {signal.SIGTERM, signal.SIGKILL} if kind == "raise" else set()
    problems += [f"a rank ended by signal {s}" for s in sorted(signals)]
    return problems, seconds


def run_torchrun(kind: str, out: Path, timeout: float) -> tuple[list[int], str, list[str]]:
    """Under torchrun, whose agent hosts the store the fault watch reads and outlives every rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROCS}",
           str(WORKER), kind, str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    RUNNING[:] = [proc.pid]
    problems = []
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        problems.append(f"no end within {timeout:g} s")
    time.sleep(0.5)  # torchrun has reaped its ranks before it exits; anything left in the session is a leftover
    problems += _leftovers(proc.pid)
    return [proc.returncode], output, problems


def run_ranks(kind: str, out: Path, timeout: float) -> tuple[list[int], str, list[str]]:
    """The ranks started as srun starts them: each with its rank in the environment, rank 0 hosting the store
    (in its own process: it may end while the others still read it); every rank's exit code is checked."""
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(NPROCS),
           "NODE_RANK": "0"}
    procs, logs = [], []
    for rank in range(NPROCS):
        logs.append(open(out / f"rank{rank}.log", "w+"))
        group = procs[0].pid if procs else 0  # one process group for the launch, as a session would be
        procs.append(subprocess.Popen([sys.executable, str(WORKER), kind, str(out)], stdout=logs[-1],
                                      stderr=subprocess.STDOUT, env={**env, "LOCAL_RANK": str(rank)}, process_group=group))
        RUNNING[:] = [procs[0].pid]
    deadline, problems = time.monotonic() + timeout, []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(procs[0].pid, signal.SIGKILL)
            problems.append(f"no end within {timeout:g} s")
            break
    codes = [proc.wait() for proc in procs]
    problems += _leftovers(procs[0].pid)
    output = ""
    for rank, log in enumerate(logs):
        log.seek(0)
        output += "".join(f"[rank {rank}] {line}" for line in log)
        log.close()
    return codes, output, problems


RUNNING: list[int] = []
"""The process group of the launch running now: an interrupted stress run kills it on its way out."""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leftovers(session: int) -> list[str]:
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return []
    os.killpg(session, signal.SIGKILL)
    return ["a process of the launch outlived it"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the ranks (default: 2)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--launcher", choices=("torchrun", "ranks"), default="torchrun",
                        help="ranks: started one by one with their ranks in the environment, as srun does")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a launch counts as hung")
    parser.add_argument("--minutes", type=float, default=None, help="start no launch after this many minutes")
    parser.add_argument("--out", type=Path, default=None, help="keep each launch's output here")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    out = args.out or Path(tempfile.mkdtemp(prefix="stress-ends-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hogs are killed on the way out
    hogs = [hog() for _ in range(args.hogs)]
    failed, seconds = Counter(), {kind: [] for kind in kinds}
    stop_at = time.monotonic() + 60 * args.minutes if args.minutes else float("inf")
    try:
        for repeat in range(args.repeats):
            if time.monotonic() > stop_at:
                break
            for kind in kinds:
                problems, took = launch(kind, out / f"{kind}-{repeat}", args.timeout, args.launcher)
                seconds[kind].append(took)
                failed[kind] += bool(problems)
                print(f"{kind} #{repeat + 1}: {took:.1f} s, load {os.getloadavg()[0]:.1f}: "
                      f"{'; '.join(problems) or 'ok'}", flush=True)
    finally:
        for process in hogs:
            process.kill()
            process.wait()
        for group in RUNNING:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    for kind in kinds:
        runs = len(seconds[kind])
        print(f"{kind}: {runs - failed[kind]}/{runs} ended as they should; {min(seconds[kind]):.1f}-"
              f"{max(seconds[kind]):.1f} s per launch (outputs under {out})")
    return 1 if sum(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
