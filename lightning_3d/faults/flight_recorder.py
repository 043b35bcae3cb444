"""NCCL's Flight Recorder in hang reports: which collective each rank was in, not only its Python stack.

On NCCL a rank's Python stack shows where it next waits for the GPU (an ``.item()``, a ``wait()``), not the
collective that never completed: kernels run asynchronously. PyTorch's Flight Recorder keeps the last
collectives of every process group (operation, sizes, state: scheduled / started / completed) and dumps
them to a file per rank; ``torchfrtrace DIR`` then names the first collective the ranks disagree on.

Before an NCCL process group is created, :func:`flight_recorder_settings` turns it on through the
variables torch 2.13 reads (``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp``, ``FlightRecorder.hpp``),
each only where the user has not set it under any of its names:

* ``TORCH_FR_BUFFER_SIZE=2000``: collectives kept (torch's default; an explicit value survives its
  changes). ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is the older name: torch warns that it is deprecated.
* ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: dump when a collective times out. (It also makes NCCL's monitor
  thread read the dump pipe below every second; without it, once per heartbeat timeout, 8 minutes.)
* ``TORCH_FR_DUMP_TEMP_FILE``: where, as a prefix + global rank (older name:
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; torch's default, ``~/.cache/torch/comm_lib_trace_rank_``, is the same
  for every job). Ours: one directory per job under ``~/.cache/torch/lightning_3d_flight_recorder/``.
* ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``: a named pipe that makes NCCL dump on request. The hang watchdog
  (``hang_timeout``, 900 s) ends a job before NCCL's own collective timeout (30 min) would dump, so
  :meth:`FlightRecorder.request_dump` asks for the dump through it before the rank goes away.
"""

from __future__ import annotations

import atexit
import glob
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

# Each setting under its names in torch 2.13, the one torch prefers first (it warns for the others).
BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_PIPE = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",)
DYNAMIC_DUMP_FILE = "TORCH_FR_DUMP_DYNAMIC_FILE_NAME"  # set: the file is TORCH_FR_DUMP_TEMP_FILE, no rank added
DUMP_WAIT = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"  # how long NCCL itself waits for a dump; we wait as long
TRACE_BUFFER_SIZE = "2000"
TORCH_DEFAULT_DUMP_FILE = os.path.join("~", ".cache", "torch", "comm_lib_trace_rank_")
OUR_DUMP_DIR = os.path.join("~", ".cache", "torch", "lightning_3d_flight_recorder")


def uses_nccl(backend: Optional[str]) -> bool:
    """``"nccl"``, or a per-device backend string with NCCL in it (``"cuda:nccl,cpu:gloo"``)."""
    return any(part.split(":")[-1].strip() == "nccl" for part in (backend or "").split(","))


def flight_recorder_settings(backend: Optional[str], environ: Mapping[str, str], pid: int) -> dict[str, str]:
    """The variables to add to ``environ`` before the process group of ``backend`` is created: none for a
    backend without NCCL, and none that the user set already (under any of torch's names for it).

    >>> flight_recorder_settings("gloo", {}, pid=1)
    {}
    >>> flight_recorder_settings("nccl", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, pid=1)["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    '1'
    """
    if not uses_nccl(backend):
        return {}
    wanted = {
        BUFFER_SIZE: TRACE_BUFFER_SIZE,
        DUMP_ON_TIMEOUT: "1",
        DUMP_FILE: os.path.join(os.path.expanduser(OUR_DUMP_DIR), _job_name(environ, pid), "rank_"),
        # A pipe per process, on the local disk: another job on this host may have ranks of the same numbers.
        DUMP_PIPE: os.path.join(tempfile.gettempdir(), f"lightning_3d_flight_recorder_{pid}_rank_"),
    }
    return {names[0]: value for names, value in wanted.items() if not any(name in environ for name in names)}


def enable_flight_recorder(backend: Optional[str], environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Apply :func:`flight_recorder_settings` to ``environ`` (``os.environ``) and create the dump directory
    they name (torch writes the file but not its directory). Returns what was set."""
    environ = os.environ if environ is None else environ
    settings = flight_recorder_settings(backend, environ, os.getpid())
    environ.update(settings)
    if DUMP_FILE[0] in settings:
        os.makedirs(os.path.dirname(settings[DUMP_FILE[0]]), exist_ok=True)
    if DUMP_PIPE[0] in settings:  # NCCL creates the pipe and leaves it behind; ours goes at a normal exit
        atexit.register(_remove_pipes, settings[DUMP_PIPE[0]])
    return settings


def _job_name(environ: Mapping[str, str], pid: int) -> str:
    # The same on every rank of a job without a collective (there is no process group yet): the run id that
    # torchrun and Slurm give, else the rendezvous port that Lightning's launcher gives all ranks.
    for variable, label in (("TORCHELASTIC_RUN_ID", "run_"), ("SLURM_JOB_ID", "slurm_"), ("MASTER_PORT", "port_")):
        if environ.get(variable):
            return label + environ[variable]
    return f"pid_{pid}"


@dataclass(frozen=True)
class FlightRecorder:
    """Where NCCL dumps this rank's Flight Recorder, and how to ask it to (for the hang report)."""

    dump_path: str
    """The file NCCL writes: the dump prefix + this rank's global rank."""
    prefix: str
    """The part of the file name before the rank, which ``torchfrtrace --prefix`` takes."""
    pipe_path: Optional[str]
    """The named pipe NCCL reads dump requests from; None when no pipe is configured."""
    wait_s: float
    """How long to wait for the dump once asked (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, 15 s)."""

    @classmethod
    def of(cls, backend: Optional[str], rank: int, environ: Mapping[str, str]) -> Optional["FlightRecorder"]:
        """The recorder of a process group on ``backend`` as ``environ`` configures it; None without NCCL."""
        if not uses_nccl(backend):
            return None
        prefix = _first(environ, DUMP_FILE) or os.path.expanduser(TORCH_DEFAULT_DUMP_FILE)
        dynamic = environ.get(DYNAMIC_DUMP_FILE, "0").lower() in ("1", "true", "yes", "y")
        pipe = _first(environ, DUMP_PIPE)
        return cls(dump_path=prefix if dynamic else f"{prefix}{rank}", prefix=os.path.basename(prefix),
                   pipe_path=f"{pipe}{rank}.pipe" if pipe else None,
                   wait_s=int(environ.get(DUMP_WAIT, "15000")) / 1000)

    def request_dump(self) -> Optional[str]:
        """Ask NCCL to dump now; it does so on its own thread. Returns why it could not be asked, or None."""
        if self.pipe_path is None:
            return f"no {DUMP_PIPE[0]} is set, so it cannot be asked to dump before the collective timeout"
        try:
            # Non-blocking: with no reader (NCCL's monitor thread not started) this fails instead of waiting.
            fd = os.open(self.pipe_path, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
        except OSError as error:
            return f"could not ask it to dump through {self.pipe_path} ({error.strerror or error})"
        return None

    def report(self, asked_at: float, not_asked: Optional[str]) -> str:
        """The hang report's line: the dump written since ``asked_at`` (``time.time()``), waiting up to
        ``wait_s`` for it, or why there is none."""
        written = self._wait_for_dump(asked_at) if not_asked is None else False
        directory = os.path.dirname(self.dump_path) or "."
        if written:
            state = f"this rank's last collectives are in {self.dump_path}"
        elif not_asked is None:
            state = (f"asked for a dump to {self.dump_path}, none written within {self.wait_s:g} s"
                     f" ({DUMP_WAIT})")
        else:
            state = f"{not_asked}; NCCL dumps to {self.dump_path} when a collective times out"
        return (f"  NCCL Flight Recorder: {state}. Every rank writes its own file there; `torchfrtrace {directory}"
                f" --prefix {self.prefix}` names the collective the ranks disagree on.")

    def _wait_for_dump(self, asked_at: float) -> bool:
        deadline, size = time.monotonic() + self.wait_s, -1
        while time.monotonic() < deadline:
            try:
                stat = os.stat(self.dump_path)
            except OSError:
                stat = None
            # Written since the request, and done: NCCL writes the file in one go, so a size that stopped
            # changing between two looks is the whole dump.
            if stat is not None and stat.st_mtime >= asked_at - 1 and stat.st_size > 0:
                if stat.st_size == size:
                    return True
                size = stat.st_size
            time.sleep(min(0.1, self.wait_s / 10))
        return False


def _remove_pipes(stem: str) -> None:
    for path in glob.glob(f"{glob.escape(stem)}*.pipe"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> Optional[str]:
    # torch reads the first name set, in this order (getCvarString).
    return next((environ[name] for name in names if environ.get(name)), None)
