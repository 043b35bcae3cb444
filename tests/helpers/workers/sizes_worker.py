"""Entry point of a sizes catalogue's launch: every rank runs each named case of ``helpers.sizes.CASES`` (of
this launch's world size); rank 0 writes ``results.json``.

    python -m torch.distributed.run --standalone --nproc-per-node N sizes_worker.py OUT_DIR NAME [NAME ...]
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch.distributed as dist

from helpers.launchers import end_process_group
from helpers.sizes import CASES, run_case
from lightning_3d import ThreeDStrategy


def main(out_dir: str, names: list[str]) -> None:
    results = {}
    for name in names:
        results[name] = run_case(CASES[name], partial(ThreeDStrategy, **CASES[name].strategy), CASES[name].world)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=1))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
