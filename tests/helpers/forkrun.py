"""A torchrun for the tests' own workers that pays the imports once per test session, not once per rank.

    python forkrun.py --nproc-per-node=N SCRIPT ARGS...   (as: python -m torch.distributed.run --standalone ...)
    python forkrun.py --serve                             (launches on request: launchers.run_forked)

On 2 cores one rank's start (importing torch, Lightning, torchmetrics, lightning_3d) costs ~8 CPU seconds,
so a launch of 8 ranks spent over a minute before its first step. Here one interpreter imports all of it,
then forks the ranks: each is a process of its own, with the environment torchrun gives a rank (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*; the key-value store hosted by the launch, as
torchrun's agent hosts it), and runs SCRIPT as ``__main__``. With ``--serve`` the interpreter stays for the
whole session and forks each launch from its pristine state. Results are bit-identical to torchrun's
(measured on parity cases at pp2 x tp2, dp2 x pp2, tp4, pp4 interleaved). What torchrun itself does
(restarts, its error summary, ``-m lightning_3d`` under it) and what a fork would change (a rank's peak
memory: test_meta_init_memory) are tested through real torchrun.

Forking is safe here because this process starts no thread before it forks (torch's pools start on first
use; one thread per rank). As torchrun does, the first rank to fail ends the others (SIGTERM, then SIGKILL)
and the launch exits non-zero, naming it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta

STOP_GRACE_S = 5.0
"""Seconds the other ranks get after SIGTERM, once one rank failed, before SIGKILL."""


def _parse(argv: list[str]) -> tuple[int, list[str]]:
    if not argv or not argv[0].startswith("--nproc-per-node="):
        sys.exit(f"usage: forkrun.py --nproc-per-node=N SCRIPT|-m MODULE ARGS... (got {argv[:2]})")
    return int(argv[0].split("=", 1)[1]), argv[1:]


def _rank_environment(rank: int, nprocs: int, port: int) -> dict[str, str]:
    """What torchrun (PyTorch 2.13, --standalone, one node) puts in a rank's environment, less its error file."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), ROLE_WORLD_SIZE=str(nprocs),
                GROUP_WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT=str(port),
                TORCHELASTIC_RUN_ID=f"forkrun-{os.getpid()}", TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="True",
                TORCH_NCCL_ASYNC_ERROR_HANDLING="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def _run_rank(rank: int, nprocs: int, port: int, target: list[str]) -> None:
    """In the forked child: become rank ``rank`` and run the target as __main__; never returns."""
    import runpy

    import numpy as np
    from lightning_utilities.core.rank_zero import rank_zero_only

    code = 0
    try:
        os.environ.update(_rank_environment(rank, nprocs, port))
        rank_zero_only.rank = rank  # Lightning reads RANK when it is imported, which was before the fork
        np.random.seed()  # a fresh interpreter's numpy draws its own seed (Python's random reseeds at fork)
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path[0] = os.path.dirname(os.path.abspath(target[0]))  # as `python SCRIPT` sets it
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- a rank's exception is its exit code and its traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop(pids: dict[int, int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
        else:
            pids.pop(pid, None)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _preload() -> None:
    """What every worker imports; each rank would otherwise import it again."""
    import helpers.harness  # noqa: F401 -- torch, Lightning, torchmetrics, lightning_3d.callbacks/models, test models
    import lightning_3d  # noqa: F401 -- the strategy, the engine, torch.distributed.pipelining

    _preload_transformers()


def _preload_transformers() -> None:
    """transformers and its causal LMs' modules (it loads each on first use): the census' ranks use 155 of them,
    launch after launch, and every Hugging Face case some (an import of ~8 CPU seconds per rank on 2 cores).
    Starts no thread. Without the ``hf`` extra: nothing."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        try:
            getattr(transformers, name)
        except Exception:  # a model whose own dependency is missing: its case reports that itself
            continue


def launch(nprocs: int, target: list[str]) -> int:
    """Fork ``nprocs`` ranks running ``target``, host their store, wait for them: the launch's exit code."""
    import torch.distributed as dist

    listener = socket.create_server(("localhost", 0))  # the store's port, held from before the fork
    port = listener.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:
            listener.close()
            _run_rank(rank, nprocs, port, target)
        pids[pid] = rank
    # The ranks' store, as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE): started after the forks,
    # since its server thread must not be copied into them.
    store = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1),
                          master_listen_fd=listener.detach(), use_libuv=False)
    while pids:
        pid, status = os.waitpid(-1, 0)
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"forkrun: rank {rank} (pid {pid}) exited with {code}; stopping ranks "
                  f"{sorted(pids.values())}", file=sys.stderr, flush=True)
            _stop(pids)
            return 1
    del store
    return 0


def serve() -> None:
    """``forkrun.py --serve``: one interpreter's imports for a whole test session. Each request (a JSON line on
    stdin: nprocs, target, cwd, env, stdout and stderr file paths) is launched in a child of this pristine
    process, in a session of its own (its process group id is the reply, for a timeout's kill), and its exit
    code is the second reply. The first reply says the imports are done. Ends when stdin closes (the tests'
    process is gone)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed here goes to the log, not among the replies
    _preload()
    print(json.dumps({"ready": os.getpid()}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os.close(replies.fileno())
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            code = 1
            try:
                code = launch(request["nprocs"], request["target"])
            except BaseException:  # noqa: BLE001 -- said in the launch's stderr; the exit code fails it
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(json.dumps({"pgid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        try:  # a rank that outlived its launch (the launch itself crashed): it must not outlive the test
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        serve()
        return 0
    nprocs, target = _parse(argv)
    _preload()
    return launch(nprocs, target)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
