"""Starting the ranks of a test, each launch with a timeout and the ranks' output when it fails.

``forkrun``: the ranks forked from the session's fork server (forkrun.py), which imported torch,
Lightning and lightning_3d once -- for the tests' own workers. ``torchrun``: real torchrun, where the
launcher or a process-level property is what the test checks (the CLI under torchrun, fault reports and
restarts, Slurm, a rank's peak memory)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch.distributed as dist


def run_to_end(cmd: list[str], *, env: dict, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` with captured text output, in a session of its own: when it hangs
    (:class:`Progress`) the whole process group is killed (torchrun's ranks too, which killing torchrun alone
    would leave running)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    progress = Progress(proc.pid, timeout)
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=progress.next_check())
            break
        except subprocess.TimeoutExpired:
            hung = progress.hung()
            if hung:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                raise LaunchHung(cmd, timeout, hung, stdout, stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


class Progress:
    """Whether a launch (every process of process group ``pgid``) is hung, rather than slow on a loaded host.

    A launch past its ``timeout`` goes on while its processes use CPU time: on 2 cores at load 15 a launch
    takes several times what it takes on idle ones, and a limit is for a hang, not for a slow machine. It is
    hung once past ``timeout`` when in the last ``STALL_S`` seconds they used less than ``MIN_CPU_SHARE`` of
    one core together (ranks waiting for each other, or for a rank that sleeps, use none; a launch slowed by a
    loaded host uses far more), and at ``HARD_CAP`` x ``timeout`` whatever they do (a rank spinning forever).
    pytest's own limit (``timeout`` in pyproject.toml, per test) still applies."""

    STALL_S = 60.0
    MIN_CPU_SHARE = 0.01
    HARD_CAP = 4

    def __init__(self, pgid: int, timeout: float) -> None:
        self.pgid, self.timeout = pgid, timeout
        self.started = time.monotonic()
        self.samples = [(self.started, group_cpu_s(pgid))]  # (when, the group's CPU seconds), the last STALL_S

    def next_check(self) -> float:
        """Seconds until the next look: a sixth of ``STALL_S``, and one at ``timeout``."""
        until_timeout = self.started + self.timeout - time.monotonic()
        return max(0.05, min(self.STALL_S / 6, until_timeout) if until_timeout > 0 else self.STALL_S / 6)

    def hung(self) -> str | None:
        """Why the launch counts as hung now, or None (slow but moving, or not past its ``timeout`` yet)."""
        now = time.monotonic()
        self.samples = [(t, cpu) for t, cpu in self.samples if now - t <= self.STALL_S] + [(now, group_cpu_s(self.pgid))]
        ran = now - self.started
        if ran < self.timeout:
            return None
        if ran >= self.HARD_CAP * self.timeout:
            return f"still running after {ran:.0f} s ({self.HARD_CAP} x its timeout of {self.timeout:g} s)"
        (first, cpu_then), (_, cpu_now) = self.samples[0], self.samples[-1]
        if now - first >= self.STALL_S * 0.8 and cpu_now - cpu_then < self.MIN_CPU_SHARE * (now - first):
            return (f"past its timeout of {self.timeout:g} s, its processes used {cpu_now - cpu_then:.2f} s of CPU"
                    f" in the last {now - first:.0f} s: hung")
        return None


class LaunchHung(subprocess.TimeoutExpired):
    """A launch killed as hung (:class:`Progress`); ``why`` says how it was told from a slow one."""

    def __init__(self, cmd, timeout: float, why: str, output, stderr) -> None:
        super().__init__(cmd, timeout, output=output, stderr=stderr)
        self.why = why

    def __str__(self) -> str:
        return f"Command '{self.cmd}' was killed: {self.why}"


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of process group ``pgid``, from /proc."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, ..., utime (12), stime (13)
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def torchrun(nprocs: int, *args: str, timeout: float = 300, cwd: Path | None = None,
             rank_files: Path | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nprocs ARGS`` with one thread per rank; fails the test with the
    ranks' stderr if it exits non-zero, and within ``timeout`` seconds if it hangs.

    With ``rank_files`` (the folder where each rank writes ``rank{N}.json`` when its work is done): a rank that
    gloo aborted on its way out (``GLOO_EXIT_ABORT``) after every file was written is a warning, not a failure."""
    return _run_ranks(TORCHRUN, nprocs, args, timeout, cwd, rank_files)


def forkrun(nprocs: int, *args: str, timeout: float = 300, cwd: Path | None = None,
            rank_files: Path | None = None) -> subprocess.CompletedProcess:
    """:func:`torchrun`'s contract, with the ranks forked from one interpreter that imported torch, Lightning
    and lightning_3d once (forkrun.py): for the tests' own workers, where the launcher is not under test."""
    return _run_ranks(FORKRUN, nprocs, args, timeout, cwd, rank_files)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
FORKRUN = [sys.executable, str(Path(__file__).parent / "forkrun.py")]


def _run_ranks(launcher: list[str], nprocs: int, args: tuple[str, ...], timeout: float, cwd: Path | None,
               rank_files: Path | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(2):
        if launcher is FORKRUN:
            proc = run_forked(nprocs, list(args), env=env, timeout=timeout, cwd=cwd)
        else:
            proc = run_to_end([*launcher, f"--nproc-per-node={nprocs}", *args], env=env, timeout=timeout, cwd=cwd)
        # Once in a full run on 2 loaded cores, gloo's rendezvous of 8 ranks failed ("connectFullMesh failed ...
        # Connection closed by peer") before any rank did its work; the same launch passed alone three times.
        # Such a launch is run once more; any other failure, or the same one twice, fails the test.
        if proc.returncode == 0 or GLOO_CONNECT_FAILED not in proc.stderr or attempt:
            break
        warnings.warn(f"gloo's rendezvous of {nprocs} ranks failed; launching once more: {proc.stderr[-600:]}")
    written = rank_files is not None and all((rank_files / f"rank{r}.json").exists() for r in range(nprocs))
    if proc.returncode != 0 and written and GLOO_EXIT_ABORT in proc.stderr:
        warnings.warn(f"the launch of {nprocs} ranks exited with {proc.returncode} after every output was "
                      f"written: {proc.stderr[-1500:]}")
        return proc
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


GLOO_EXIT_ABORT = "terminate called without an active exception"
GLOO_CONNECT_FAILED = "Gloo connectFullMesh failed"


def end_process_group() -> None:
    """End a worker: destroy its process group, then leave without running C++ static destructors. Left to
    interpreter exit, gloo has been seen to abort a rank (``GLOO_EXIT_ABORT``) after all its work was done."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- fork server


def run_forked(nprocs: int, args: list[str], *, env: dict, timeout: float,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``forkrun.py --nproc-per-node=nprocs ARGS`` as :func:`run_to_end` runs a command (output captured, the
    whole launch killed after ``timeout`` seconds), forked from the session's fork server (forkrun.py
    --serve: the imports paid once per session, not once per launch) when ``env`` is the one it started with
    (what the imports read), else from a fresh interpreter."""
    global _SERVER
    if _SERVER is None or not _SERVER.alive():
        _SERVER = _ForkServer(env)
    if _SERVER.env == _without_per_test(env):
        return _SERVER.run(nprocs, args, env=env, timeout=timeout, cwd=cwd)
    return run_to_end([*FORKRUN, f"--nproc-per-node={nprocs}", *args], env=env, timeout=timeout, cwd=cwd)


def _without_per_test(env: dict) -> dict:
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's, new in every test


class _ForkServer:
    """The client side of ``forkrun.py --serve``: one launch at a time, in a temporary folder for its output."""

    def __init__(self, env: dict) -> None:
        self.env = _without_per_test(env)
        self.folder = Path(tempfile.mkdtemp(prefix="forkrun-"))
        atexit.register(shutil.rmtree, self.folder, ignore_errors=True)
        with open(self.folder / "server.log", "w") as log:
            self.proc = subprocess.Popen([*FORKRUN, "--serve"], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        self._pending = b""
        self._launch_pgid: int | None = None
        atexit.register(self.close)
        self._reply(time.monotonic() + SERVER_START_TIMEOUT_S)  # {"ready": pid}: imports done

    def close(self) -> None:
        """End the server (it leaves when its stdin closes) and reap it, so that its CPU time, and its
        launches', count as this process's children's, as a launch's own processes would."""
        if self._launch_pgid is not None:  # interrupted mid-launch (Ctrl-C): it must not outlive the tests
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._launch_pgid, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, nprocs: int, args: list[str], *, env: dict, timeout: float,
            cwd: Path | None) -> subprocess.CompletedProcess:
        out, err = self.folder / "stdout", self.folder / "stderr"
        request = dict(nprocs=nprocs, target=args, cwd=str(cwd or os.getcwd()), env=env, stdout=str(out),
                       stderr=str(err))
        cmd = [*FORKRUN, f"--nproc-per-node={nprocs}", *args]
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        self._launch_pgid = self._reply(time.monotonic() + timeout)["pgid"]
        progress = Progress(self._launch_pgid, timeout)
        while True:
            try:
                code = self._reply(time.monotonic() + progress.next_check())["exit"]
                break
            except subprocess.TimeoutExpired:
                hung = progress.hung()
                if hung:
                    os.killpg(self._launch_pgid, signal.SIGKILL)
                    self._reply(time.monotonic() + 60)  # the server reaps the launch and says so
                    self._launch_pgid = None
                    raise LaunchHung(cmd, timeout, hung, out.read_text(), err.read_text()) from None
        self._launch_pgid = None  # left set only when interrupted (KeyboardInterrupt): close() kills the launch
        return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())

    def _reply(self, deadline: float) -> dict:
        """The server's next reply line, read from its pipe without blocking past ``deadline``."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("forkrun.py --serve", 0)
            chunk = os.read(fd, 4096)
            if not chunk:
                log = (self.folder / "server.log").read_text()[-3000:]
                raise AssertionError(f"the fork server ended (exit {self.proc.wait()}):\n{log}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


_SERVER: _ForkServer | None = None
SERVER_START_TIMEOUT_S = 600
"""For the fork server's imports (~10 s on an idle 2-core machine); not counted in any launch's timeout."""
