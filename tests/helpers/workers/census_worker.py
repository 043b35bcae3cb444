"""Entry point of one census launch (``helpers.census.running``): every rank runs every case and keeps going
past a case that raises, so that one launch judges many models.

    python forkrun.py --nproc-per-node N census_worker.py CASES.json OUT_DIR

Per case, rank 0 saves the Result as ``NAME.pt``; a rank that raises saves ``NAME.rank{R}.error.json`` (the
exception's class, whether lightning_3d raised it on purpose, its message). After a case that raised, the
ranks meet at a monitored barrier: if one of them is gone (the fault watch ends a rank blocked in a
collective that another left), the others exit non-zero and the launcher starts the remaining cases anew.
"""

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.harness import Case, run_distributed
from helpers.launchers import end_process_group

BARRIER_S = 60
"""How long the ranks wait for each other after a case that raised (a refusal on every rank comes within the
fault watch's exit_timeout of each other, 10 s by default)."""
GROUP_BROKEN = 3
"""The exit code of a rank whose peers are gone."""


def main(cases_file: str, out_dir: str) -> None:
    for raw in json.loads(Path(cases_file).read_text()):
        case = Case(**raw)
        started, cpu = time.perf_counter(), time.process_time()
        try:
            result = run_distributed(case)
        except Exception as err:  # recorded per case: the census goes on with the next one
            rank = dist.get_rank()
            Path(out_dir, f"{case.name}.rank{rank}.error.json").write_text(json.dumps(describe(err)))
            print(f"[census] {case.name}: rank {rank} raised {type(err).__name__} after"
                  f" {time.perf_counter() - started:.2f} s", flush=True)
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=BARRIER_S), wait_all_ranks=True)
            except RuntimeError as gone:
                print(f"[census] rank {rank}: a peer is gone after {case.name}, leaving: {gone}", flush=True)
                sys.stdout.flush()
                os._exit(GROUP_BROKEN)  # not sys.exit: this rank's own fault watch may still hold the group
            continue
        if result is not None:
            torch.save(result, Path(out_dir) / f"{case.name}.pt")
            print(f"[census] {case.name}: {time.perf_counter() - started:.2f} s, rank 0's CPU"
                  f" {time.process_time() - cpu:.2f} s", flush=True)
    end_process_group()


def describe(err: BaseException) -> dict:
    """What the census reports of an exception: a refusal is one of lightning_3d's own error classes."""
    from lightning_3d import errors

    refused = any(isinstance(err, cls) for cls in vars(errors).values()
                  if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == errors.__name__)
    return dict(type=f"{type(err).__module__}.{type(err).__qualname__}", refused=refused, message=str(err),
                traceback="".join(traceback.format_exception(err))[-3000:])


if __name__ == "__main__":
    main(*sys.argv[1:3])
