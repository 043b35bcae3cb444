"""The step results' channel on 2 ranks (tests/parity/test_results_channel.py): rank 1 sends, rank 0 receives,
over a group of their own, for four steps; in steps 2-4 rank 0 posts its receive ahead (``expect``) and is then
busy for a second before it reads, as a first stage is with its last backward while the last stage sends. The
structure changes at step 3 (a logged value added). Rank 0 writes what it received and how long rank 1's sends
took.

    python -m torch.distributed.run --nproc-per-node 2 results_channel_worker.py OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.launchers import end_process_group
from lightning_3d.pipeline.shared_results import ResultsChannel

BUSY_S = 1.0


def payload(step: int) -> dict:
    logs = {"loss": torch.tensor(1.0 / step)}
    if step >= 3:
        logs["acc"] = torch.tensor([step, 2 * step], dtype=torch.int64)
    return {"value": torch.full((2, 3), float(step)), "logs": logs}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    channel = ResultsChannel(1, group, torch.device("cpu"))
    received, send_seconds = [], []
    for step in range(1, 5):
        dist.barrier()  # both ranks start the step together
        if rank == 1:
            start = time.perf_counter()
            channel.share(payload(step))
            send_seconds.append(time.perf_counter() - start)
        else:
            channel.expect()  # no-op at step 1: the structure is not known yet
            time.sleep(BUSY_S if step > 1 else 0.0)
            got = channel.share(None)
            received.append({"value": got["value"].tolist(),
                             "logs": {name: value.tolist() for name, value in got["logs"].items()}})
    sends = [None, None]
    dist.all_gather_object(sends, send_seconds)
    if rank == 0:
        expected = [{"value": payload(s)["value"].tolist(),
                     "logs": {n: v.tolist() for n, v in payload(s)["logs"].items()}} for s in range(1, 5)]
        (Path(out_dir) / "rank0.json").write_text(json.dumps(
            {"received": received, "expected": expected, "send_seconds": sends[1],
             "structure_sends": channel.structure_sends}))
    (Path(out_dir) / f"rank{rank}.done").write_text("")
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
