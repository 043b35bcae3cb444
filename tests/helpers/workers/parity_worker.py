"""Entry point of one parity launch (``helpers.harness.launch``): every rank runs every case; rank 0 saves results.

    python -m torch.distributed.run --standalone --nproc-per-node N parity_worker.py CASES.json OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

import torch

from helpers.harness import Case, run_distributed
from helpers.launchers import end_process_group


def main(cases_file: str, out_dir: str) -> None:
    for raw in json.loads(Path(cases_file).read_text()):
        case = Case(**raw)
        started = time.perf_counter()
        result = run_distributed(case)
        if result is not None:
            torch.save(result, Path(out_dir) / f"{case.name}.pt")
            print(f"[parity] {case.name}: losses {['%.6f' % x for x in result.losses]}"
                  f" ({time.perf_counter() - started:.1f} s)", flush=True)
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
